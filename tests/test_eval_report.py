"""results.json, results.md and acceptance.png from constructed results, and the `wingspan eval` command's
help and input errors (exit 2, a message, no traceback) without any model."""

import json
import sys

import pytest
import torch

from wingspan.cli import main
from wingspan.decode.primitives import SpecResult
from wingspan.errors import MissingPackageError
from wingspan.eval.prompts import EvalPrompt
from wingspan.eval.report import write_report
from wingspan.eval.runner import EvalSettings, Turn, prompt_result, summarize

CPU = torch.device("cpu")


def constructed_set(name: str, compare: bool = True):
    """Two prompts: one accepting all 3 drafts twice, one accepting 1 then 0, and a baseline that differs on
    the second prompt. tau = (4 + 4 + 2 + 1) / 4 = 2.75; per position: 3/4, 2/4, 2/4."""

    def turn(accepted, tokens, seconds, reply):
        result = SpecResult(list(range(tokens)), 1 + len(accepted), accepted, [3] * len(accepted), draft_s=seconds / 4)
        return Turn(prompt_ids=list(range(12)), result=result, seconds=seconds, reply=reply)

    rows = [
        prompt_result(EvalPrompt("a", ["q"], "math"), [turn([3, 3], 9, 1.0, "x")], [turn([], 9, 2.0, "x")], compare),
        prompt_result(EvalPrompt("b", ["q"]), [turn([1, 0], 4, 1.0, "y")], [turn([], 5, 1.0, "z")], compare),
    ]
    return summarize(name, rows)


def test_report_files_hold_the_numbers(tmp_path):
    greedy, sampled = constructed_set("mt_bench"), constructed_set("sampled", compare=False)
    assert greedy.acceptance_length == pytest.approx(2.75)
    settings = EvalSettings(max_new_tokens=64, limit=2, exclude=["gsm8k"])
    write_report(tmp_path, [greedy, sampled], settings, target="tiny", draft="runs/draft", dtype="float32", device=CPU)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acceptance.png", "results.json", "results.md"]  # no .tmp

    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["target"], results["draft"], results["dtype"]) == ("tiny", "runs/draft", "float32")
    assert results["environment"]["device"].startswith("cpu (")  # where it was measured, with its vector unit
    assert results["settings"]["max_new_tokens"] == 64 and results["settings"]["limit"] == 2
    assert results["settings"]["exclude"] == ["gsm8k"]
    first = results["sets"][0]
    assert first["acceptance_length"] == pytest.approx(2.75)
    assert first["acceptance_per_position"] == pytest.approx([0.75, 0.5, 0.5])
    assert first["spec_tokens_per_s"] == pytest.approx(13 / 2.0)
    assert first["greedy_tokens_per_s"] == pytest.approx(14 / 3.0)
    assert [p["id"] for p in first["prompts"]] == ["a", "b"]
    assert first["prompts"][1]["greedy_replies"] == ["z"] and first["prompts"][1]["accepted_per_round"] == [1, 0]

    table = (tmp_path / "results.md").read_text()
    speedup = (13 / 2.0) / (14 / 3.0)
    assert f"| mt_bench | 2 | 2.750 | 0.75 / 0.50 / 0.50 | 1.750 | 6.5 | 4.7 | {speedup:.2f}x | 1 / 2 |" in table
    assert "| sampled | 2 | 2.750 |" in table and "n/a (sampled)" in table
    assert "chain of 3 drafts, greedy, up to 64 new tokens per turn, prompts found in gsm8k left out" in table
    assert (tmp_path / "acceptance.png").read_bytes().startswith(b"\x89PNG")


def test_missing_matplotlib_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingPackageError, match="pip install matplotlib"):
        write_report(
            tmp_path, [constructed_set("s")], EvalSettings(), target="t", draft="d", dtype="bfloat16", device=CPU
        )


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["wingspan", *args])
    with pytest.raises(SystemExit) as exit:
        main()
    out, err = capsys.readouterr()
    return exit.value.code, out, err


def test_cli_help(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "eval", "--help")
    assert code == 0
    for option in (
        "--target",
        "--draft",
        "--sets",
        "--out",
        "--num-draft-tokens",
        "--tree",
        "--max-new-tokens",
        "--temperature",
        "--limit",
        "--dtype",
        "--threads",
    ):
        assert option in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tree", "3,2"], "expected DEPTH,TOPK,TOTAL"),
        (["--tree", "2,2,7"], "total_tokens can be at most"),
        (["--dtype", "int8"], "dtype 'int8': expected one of"),
        (["--sets", "mt-bench"], "neither a named set (mt_bench, gsm8k, humaneval)"),
        (["--sets", "a=x.txt,a=y.txt"], "x.txt: file not found"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
    ],
)
def test_cli_input_errors(monkeypatch, capsys, tmp_path, args, message):
    code, _, err = run_cli(monkeypatch, capsys, "eval", "--draft", str(tmp_path), "--out", str(tmp_path / "out"), *args)
    assert code == 2
    assert message in " ".join(err.split())  # rich wraps long messages
    assert "Traceback" not in err


def test_cli_refuses_repeated_names_and_a_non_draft_directory(monkeypatch, capsys, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    common = ["eval", "--out", str(tmp_path / "out"), "--target", str(tmp_path)]
    code, _, err = run_cli(monkeypatch, capsys, *common, "--draft", str(tmp_path), "--sets", f"a={prompts},a={prompts}")
    assert code == 2 and "two sets are named 'a'" in err
    code, _, err = run_cli(monkeypatch, capsys, *common, "--draft", str(tmp_path), "--sets", str(prompts))
    assert code == 2 and "neither a wingspan draft" in err
