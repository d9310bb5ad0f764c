"""`wingspan eval` on a tiny random target: the metrics by hand, speculative output equal to greedy in fp32,
multi-turn prompts continued from each decoder's own answer, and the command end to end."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_speculative import FAVOURED, make_draft

from wingspan.config import load, save_json
from wingspan.data.template import chat_prompt
from wingspan.decode.primitives import SpecResult
from wingspan.errors import ConfigError, ExportError
from wingspan.eval import runner
from wingspan.eval.metrics import acceptance_length, acceptance_per_position
from wingspan.eval.prompts import EvalPrompt
from wingspan.eval.runner import (
    EvalSettings,
    Turn,
    evaluate,
    evaluate_side_by_side,
    load_models,
    prompt_result,
    summarize,
)
from wingspan.export import ExportSettings, export_draft
from wingspan.models.draft import Eagle3Draft, write_draft
from wingspan.models.target import TargetModel

BUNDLED = Path(runner.__file__).parent / "data"  # the question files the package ships
PROMPTS = [
    EvalPrompt("two-turn", ["Name a prime number.", "And a larger one?"], "math"),
    EvalPrompt("one-turn", ["Write a haiku about rain."]),
    EvalPrompt("code", ["def add(a, b):"], "code"),
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama_dir) -> TargetModel:
    """The tiny llama with its FAVOURED lm_head row scaled: about a third of its greedy tokens are FAVOURED."""
    model = TargetModel.load(str(tiny_llama_dir), dtype="float32", aux_layer_ids=[1, 2, 3])
    model.model.lm_head.weight.data[FAVOURED] *= 20
    return model


def favoured_draft(target: TargetModel, seed: int = 0) -> Eagle3Draft:
    """A 1-layer random draft whose lm_head is zero, so every proposal is draft id 0 = FAVOURED."""
    return make_draft(target, layers=1, seed=seed, draft_vocab=500, favour=0)


@pytest.fixture(scope="module")
def draft(target) -> Eagle3Draft:
    return favoured_draft(target)


def turn(accepted: list[int], drafted: list[int], tokens: int, seconds: float, draft_s: float = 0.0) -> Turn:
    result = SpecResult(list(range(tokens)), 1 + len(accepted), accepted, drafted, draft_s=draft_s)
    return Turn(prompt_ids=list(range(10)), result=result, seconds=seconds, reply="")


# ---------------------------------------------------------------------------------------------- metrics


def test_tau_counts_each_rounds_bonus_token_but_not_the_prefill():
    """Prefill gives token 1; rounds accepting 3, 0 and 2 drafts give 4 + 1 + 3: 9 tokens, 4 target forwards,
    3 of them verifications. tau = 8 / 3, not 9 / 3 nor 9 / 4."""
    spec = SpecResult(list(range(9)), target_forwards=4, accepted_per_round=[3, 0, 2], drafted_per_round=[3, 3, 3])
    row = prompt_result(PROMPTS[1], [Turn(list(range(20)), spec, 1.0, "")], [turn([], [], 9, 2.0)], compare=True)
    assert row.rounds == 3
    assert row.acceptance_length == pytest.approx(8 / 3) == acceptance_length(3, 3 + 0 + 2)
    assert acceptance_length(0, 0) is None  # a turn that ended on its prefill token has no round


def test_acceptance_per_position_on_constructed_rounds():
    accepted = [3, 0, 2, 1, 0]
    drafted = [3, 3, 3, 2, 1]  # shorter chains near max_new_tokens propose fewer positions
    # position 1: all 5 rounds proposed it, 3 accepted it; position 2: 4 rounds, 2; position 3: 3 rounds, 1.
    assert acceptance_per_position(accepted, drafted) == pytest.approx([3 / 5, 2 / 4, 1 / 3])
    assert acceptance_per_position([0, 0], [0, 0]) == []  # rounds with no draft (the last token) propose nothing


def test_set_aggregates_weigh_rounds_not_prompts():
    long = prompt_result(PROMPTS[1], [turn([3, 3], [3, 3], 10, seconds=1.0)], [turn([], [], 10, 3.0)], compare=True)
    short = prompt_result(
        PROMPTS[2], [turn([0] * 6, [3] * 6, 6, seconds=3.0, draft_s=1.0)], [turn([], [], 7, 3.0)], compare=True
    )
    result = summarize("set", [long, short])
    assert result.rounds == 8
    assert result.acceptance_length == pytest.approx((8 + 6) / 8)  # all tokens / all rounds
    assert result.acceptance_length_prompt_mean == pytest.approx((4.0 + 1.0) / 2)
    assert result.mean_accepted_per_round == pytest.approx(6 / 8)
    assert result.acceptance_per_position == pytest.approx([2 / 8, 2 / 8, 2 / 8])
    assert result.spec_tokens_per_s == pytest.approx(16 / 4.0)
    assert result.greedy_tokens_per_s == pytest.approx(17 / 6.0)
    assert result.speedup == pytest.approx((16 / 4.0) / (17 / 6.0))
    assert result.draft_time_share == pytest.approx(1.0 / 4.0)
    assert result.outputs_differing == 1 and not short.identical and short.greedy_replies == [""]
    assert long.identical and long.greedy_replies is None


def test_rounds_split_by_where_prompt_lookup_matches():
    """Two prompts' rounds, replayed by `lookup_outcomes` (test_lookup.py works them through): prompt 1 has
    rounds (draft accepted 2, 0, 1; lookup None, 0, None), prompt 2 rounds (0, 1; None, 2). Lookup's 2 in the
    last round counts the output's last two tokens [3, 1] against its drafts [3, 1, 2]."""
    first = SpecResult([1, 2, 3, 1, 9, 2, 3], 4, accepted_per_round=[2, 0, 1], drafted_per_round=[3, 3, 3])
    second = SpecResult([1, 2, 3, 1], 3, accepted_per_round=[0, 1], drafted_per_round=[2, 3])
    greedy = [turn([], [], 4, 1.0)]
    rows = [
        prompt_result(PROMPTS[1], [Turn([1, 2, 3], first, 1.0, "")], greedy, True, (2, 4), 3),
        prompt_result(PROMPTS[2], [Turn([1, 2, 3], second, 1.0, "")], greedy, True, (2, 4), 3),
    ]
    assert [row.lookup_accepted_per_round for row in rows] == [[None, 0, None], [None, 2]]
    split = summarize("set", rows).lookup
    assert (split.rounds, split.rounds_with_match) == (5, 2)
    assert split.tau_with_match == pytest.approx((2 + 0 + 1) / 2)
    assert split.lookup_tau_with_match == pytest.approx((2 + 0 + 2) / 2)
    assert (split.lookup_ahead, split.draft_ahead) == (0.5, 0.0)
    assert split.tau_without_match == pytest.approx((3 + 2 + 1 + 0) / 3)
    assert split.acceptance_with_match == pytest.approx([1 / 2, 0, 0])
    assert split.acceptance_without_match == pytest.approx([2 / 3, 1 / 3, 0])
    # Lookup decoding replayed on the same outputs, chains of 3: prompt 1 runs rounds (accepted of drafted) 0 of 0
    # ([1, 2, 3, 1] has no match), 2 of 3 ([3, 1, 2] against [3, 1, 9]), 0 of 0 and 0 of 0 (the last token);
    # prompt 2 runs 0 of 0, then 1 of 1 ([3] as the last token). 9 tokens in 6 rounds.
    assert [row.lookup_replay_accepted_per_round for row in rows] == [[0, 2, 0, 0], [0, 1]]
    assert [row.lookup_replay_drafted_per_round for row in rows] == [[0, 3, 0, 0], [0, 1]]
    assert split.lookup_tau == pytest.approx(9 / 6) and split.lookup_acceptance == pytest.approx([1, 1, 0])
    assert split.lookup_tau_where_proposed == pytest.approx((2 + 3) / 2)  # the two rounds that drafted
    unsplit = prompt_result(PROMPTS[1], [Turn([1, 2, 3], first, 1.0, "")], greedy, compare=True)
    assert unsplit.lookup_accepted_per_round is None and summarize("set", [unsplit]).lookup is None


def test_settings_validate_and_round_trip_as_json(tmp_path):
    settings = EvalSettings(tree_depth=3, tree_top_k=2, tree_total_tokens=5, max_new_tokens=64, temperature=0.5)
    save_json(settings, tmp_path / "settings.json")
    assert load(EvalSettings, tmp_path / "settings.json") == settings
    assert settings.tree.total_tokens == 5 and EvalSettings().tree is None
    with pytest.raises(ConfigError, match="depth, top_k and total_tokens together"):
        EvalSettings(tree_depth=3)
    with pytest.raises(ConfigError, match="total_tokens can be at most"):
        EvalSettings(tree_depth=2, tree_top_k=2, tree_total_tokens=7)
    with pytest.raises(ConfigError, match="num_draft_tokens: must be >= 1"):
        EvalSettings(num_draft_tokens=0)


# --------------------------------------------------------------------------------------------- decoding


def test_fp32_speculative_output_equals_greedy(target, draft):
    result = evaluate(target, draft, PROMPTS, EvalSettings(max_new_tokens=12, warmup_prompts=1))
    assert result.num_prompts == 3 and result.outputs_differing == 0
    assert all(row.identical and row.greedy_replies is None for row in result.prompts)
    assert [row.new_tokens for row in result.prompts] == [row.greedy_new_tokens for row in result.prompts]
    assert [len(row.prompt_tokens) for row in result.prompts] == [2, 1, 1]
    accepted = [a for row in result.prompts for a in row.accepted_per_round]
    assert sum(accepted) > 0  # the FAVOURED drafts are accepted where the target says FAVOURED
    assert result.rounds == len(accepted) == sum(row.rounds for row in result.prompts)
    assert result.acceptance_length == pytest.approx(sum(a + 1 for a in accepted) / len(accepted))
    assert len(result.acceptance_per_position) == 3 and result.acceptance_per_position[0] > 0
    assert result.speedup == pytest.approx(result.spec_tokens_per_s / result.greedy_tokens_per_s)
    assert all(row.spec_s > row.spec_draft_s > 0 and row.greedy_s > 0 for row in result.prompts)


def test_batches_decode_each_prompt_as_it_is_decoded_alone(target, draft):
    """Batches of 2 (a two-turn prompt beside one-turn ones, a last batch of one): in fp32 every prompt gets the
    tokens and rounds batch-1 evaluation gives it, and each call's time is shared among its prompts."""
    alone = evaluate(target, draft, PROMPTS, EvalSettings(max_new_tokens=12, warmup_prompts=0))
    batched = evaluate(target, draft, PROMPTS, EvalSettings(max_new_tokens=12, warmup_prompts=1, batch_size=2))
    assert batched.outputs_differing == 0
    for one, many in zip(alone.prompts, batched.prompts, strict=True):
        assert (many.replies, many.accepted_per_round, many.drafted_per_round) == (
            one.replies,
            one.accepted_per_round,
            one.drafted_per_round,
        )
    assert batched.acceptance_length == alone.acceptance_length
    assert all(row.spec_s > row.spec_draft_s > 0 and row.greedy_s > 0 for row in batched.prompts)
    with pytest.raises(ConfigError, match="trees are decoded one prompt at a time"):
        EvalSettings(batch_size=2, tree_depth=2, tree_top_k=2, tree_total_tokens=4)


def test_draft_shapes_side_by_side_share_one_plain_baseline(target, draft, monkeypatch):
    """A chain of 1, a chain of 3 and a tree measured together: each gives the rounds it gives alone, the plain
    runs are decoded once per batch and carried by all three, and the order rotates from batch to batch."""
    shapes = [
        EvalSettings(num_draft_tokens=1, max_new_tokens=10, warmup_prompts=0),
        EvalSettings(num_draft_tokens=3, max_new_tokens=10, warmup_prompts=0),
        EvalSettings(tree_depth=3, tree_top_k=2, tree_total_tokens=8, max_new_tokens=10, warmup_prompts=0),
    ]
    calls = []
    decode_plain = runner.plain_generate
    decode_spec = runner.speculative_generate
    monkeypatch.setattr(runner, "plain_generate", lambda *a, **kw: calls.append("plain") or decode_plain(*a, **kw))
    monkeypatch.setattr(
        runner,
        "speculative_generate",
        lambda *a, **kw: calls.append("tree" if kw["tree"] else a[4]) or decode_spec(*a, **kw),
    )
    together = evaluate_side_by_side(target, [(draft, s) for s in shapes], PROMPTS, ["k1", "k3", "tree"])
    # per turn: the first prompt has two, each decoder asks them in order; the start rotates by one each prompt
    assert calls == [1, 1, 3, 3, "tree", "tree", "plain", "plain"] + [3, "tree", "plain", 1] + ["tree", "plain", 1, 3]
    for shape, result in zip(shapes, together, strict=True):
        alone = evaluate(target, draft, PROMPTS, shape)
        assert result.outputs_differing == 0
        assert [r.accepted_per_round for r in result.prompts] == [r.accepted_per_round for r in alone.prompts]
        assert [r.greedy_s for r in result.prompts] == [r.greedy_s for r in together[0].prompts]
    with pytest.raises(ConfigError, match="may differ only in chain length and tree"):
        evaluate_side_by_side(
            target, [(draft, shapes[0]), (draft, EvalSettings(max_new_tokens=11))], PROMPTS, ["a", "b"]
        )


def test_drafts_and_prompt_lookup_side_by_side_give_what_each_gives_alone(target, draft):
    other = favoured_draft(target, seed=1)
    settings = EvalSettings(max_new_tokens=10, warmup_prompts=0)
    proposers = [(draft, settings), (None, settings), (other, settings)]
    together = evaluate_side_by_side(target, proposers, PROMPTS, ["draft", "lookup", "other"])
    for (proposer, _), result in zip(proposers, together, strict=True):
        alone = evaluate(target, proposer, PROMPTS, settings)
        assert result.outputs_differing == 0 and (result.lookup is None) == (proposer is None)
        assert [r.accepted_per_round for r in result.prompts] == [r.accepted_per_round for r in alone.prompts]
    assert together[1].acceptance_length > 1  # lookup finds the tiny target's repetitions


def test_tree_is_greedy_exact_and_sampling_is_seeded_per_prompt(target, draft):
    tree = evaluate(
        target,
        draft,
        PROMPTS[1:],
        EvalSettings(tree_depth=3, tree_top_k=2, tree_total_tokens=8, max_new_tokens=10, warmup_prompts=0),
    )
    assert tree.outputs_differing == 0
    assert max(d for row in tree.prompts for d in row.drafted_per_round) == 3
    assert len(tree.acceptance_per_position) == 3

    settings = EvalSettings(temperature=0.8, seed=7, max_new_tokens=10, warmup_prompts=0)
    sampled = evaluate(target, draft, PROMPTS[1:], settings)
    assert sampled.outputs_differing is None and all(row.identical is None for row in sampled.prompts)
    again = evaluate(target, draft, PROMPTS[2:], settings)  # the second prompt alone: the same sample
    assert again.prompts[0].replies == sampled.prompts[1].replies


def test_each_decoder_continues_its_own_conversation(target, draft, monkeypatch):
    """The second turn's prompt carries the decoder's own first answer. The baseline is made to answer
    differently (its tokens reversed) to tell the two conversations apart; the decoders alternate order."""
    calls = []

    def speculative(target, draft, ids, *args, **kwargs):
        calls.append(("spec", ids))
        return runner_speculative(target, draft, ids, *args, **kwargs)

    def greedy(target, ids, *args, **kwargs):
        result = runner_greedy(target, ids, *args, **kwargs)
        result.tokens.reverse()
        calls.append(("greedy", ids))
        return result

    runner_speculative, runner_greedy = runner.speculative_generate, runner.plain_generate
    monkeypatch.setattr(runner, "speculative_generate", speculative)
    monkeypatch.setattr(runner, "plain_generate", greedy)
    prompts = [PROMPTS[0], EvalPrompt("again", PROMPTS[0].turns)]
    result = evaluate(target, draft, prompts, EvalSettings(max_new_tokens=8, warmup_prompts=0))

    assert [which for which, _ in calls] == ["spec"] * 2 + ["greedy"] * 4 + ["spec"] * 2
    first, second = PROMPTS[0].turns
    for which, row_replies in (("spec", result.prompts[0].replies), ("greedy", result.prompts[0].greedy_replies)):
        ids = [ids for name, ids in calls if name == which][:2]
        assert ids[0] == chat_prompt(target.tokenizer, [{"role": "user", "content": first}])
        assert ids[1] == chat_prompt(
            target.tokenizer,
            [
                {"role": "user", "content": first},
                {"role": "assistant", "content": row_replies[0]},
                {"role": "user", "content": second},
            ],
        )
        assert row_replies[0] in target.tokenizer.decode(ids[1])
    assert result.prompts[0].replies[0] != result.prompts[0].greedy_replies[0]
    assert result.outputs_differing == 2


def test_prompt_lookup_against_greedy_and_the_drafts_split(target, draft):
    """With no draft, evaluate decodes with prompt lookup: greedy outputs equal, drafts accepted where the
    FAVOURED-heavy target repeats itself. With a draft, every drafted round is replayed by lookup."""
    prompts = [EvalPrompt("loop", ["Say it again: again and again and again and again."]), *PROMPTS[1:]]
    settings = EvalSettings(max_new_tokens=24, warmup_prompts=0)
    lookup = evaluate(target, None, prompts, settings)
    assert lookup.outputs_differing == 0 and lookup.lookup is None
    assert sum(a for row in lookup.prompts for a in row.accepted_per_round) > 0
    drafted = evaluate(target, draft, prompts, settings)
    assert [row.replies for row in drafted.prompts] == [row.replies for row in lookup.prompts]
    split = drafted.lookup
    assert split.rounds == sum(d > 0 for row in drafted.prompts for d in row.drafted_per_round)
    assert 0 < split.rounds_with_match < split.rounds
    with pytest.raises(ConfigError, match="prompt lookup drafts a chain"):
        evaluate(target, None, prompts, EvalSettings(batch_size=2))
    with pytest.raises(ConfigError, match="ngram_max: must be >= 3"):
        EvalSettings(ngram_min=3, ngram_max=2)


def test_first_turns_only(target, draft):
    settings = EvalSettings(max_new_tokens=4, warmup_prompts=0, first_turns=True)
    result = evaluate(target, draft, PROMPTS[:1], settings)
    assert [len(row.prompt_tokens) for row in result.prompts] == [1] and len(PROMPTS[0].turns) == 2


# ------------------------------------------------------------------------------------ models and the CLI


def test_load_models_reads_a_draft_directory_and_a_vllm_export(tiny_llama_dir, tmp_path):
    plain = TargetModel.load(str(tiny_llama_dir), dtype="float32", aux_layer_ids=[1, 2, 3])
    saved = favoured_draft(plain, seed=3)
    saved.lm_head.weight.data.normal_()
    write_draft(tmp_path / "draft", saved.trainable_state_dict(), saved.config)
    export_draft(saved, tmp_path / "vllm", "vllm", ExportSettings(dtype="float32"))
    for directory in (tmp_path / "draft", tmp_path / "vllm"):
        model, loaded = load_models(str(tiny_llama_dir), directory, "float32")
        assert model.aux_layer_ids == [1, 2, 3]  # from the draft's config (the default would be [2, 2, 1])
        assert torch.equal(loaded.lm_head.weight, saved.lm_head.weight)
        assert torch.equal(loaded.embed_tokens.weight, model.embed_weight())
    model, loaded = load_models(str(tiny_llama_dir), tmp_path / "draft", "bfloat16")
    assert loaded.fc.weight.dtype == torch.bfloat16  # the draft runs in the target's dtype, as vLLM runs it
    with pytest.raises(ExportError, match="neither a wingspan draft"):
        load_models(str(tiny_llama_dir), tmp_path, "float32")


def test_cli_writes_all_three_files(tiny_llama_dir, target, draft, tmp_path):
    write_draft(tmp_path / "draft", draft.trainable_state_dict(), draft.config)
    out = tmp_path / "eval"
    sets = f"mt={BUNDLED / 'mt_bench.jsonl'},{BUNDLED / 'gsm8k_80.jsonl'},humaneval"  # NAME=PATH, a file, a named set
    command = [
        sys.executable,
        "-m",
        "wingspan",
        "eval",
        "--target",
        str(tiny_llama_dir),
        "--draft",
        str(tmp_path / "draft"),
        "--sets",
        sets,
        "--limit",
        "2",
        "--max-new-tokens",
        "6",
        "--dtype",
        "fp32",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    offline = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # the named set is bundled
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=offline)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [s["name"] for s in results["sets"]] == ["mt", "gsm8k_80", "humaneval"]
    assert [s["num_prompts"] for s in results["sets"]] == [2, 2, 2]
    assert [len(p["prompt_tokens"]) for p in results["sets"][0]["prompts"]] == [2, 2]  # MT-bench: two turns
    assert [(p["id"], p["category"]) for p in results["sets"][2]["prompts"]] == [("0", "code"), ("1", "code")]
    assert all(s["outputs_differing"] == 0 for s in results["sets"])
    assert results["settings"]["max_new_tokens"] == 6 and results["dtype"] == "float32"
    table = (out / "results.md").read_text()
    for s in results["sets"]:
        assert f"| {s['name']} | 2 | {s['acceptance_length']:.3f} |" in table
    assert (out / "acceptance.png").read_bytes().startswith(b"\x89PNG")
    assert "| mt | 2 |" in done.stdout
    assert "| mt | " in table.split("Where prompt lookup")[1]  # the draft's rounds split by lookup's matches
    assert all(
        s["lookup"]["rounds"] == sum(d > 0 for p in s["prompts"] for d in p["drafted_per_round"])
        for s in results["sets"]
    )


def test_cli_measures_prompt_lookup_and_proposers_side_by_side(tiny_llama_dir, target, draft, tmp_path):
    base = [sys.executable, "-m", "wingspan", "eval", "--target", str(tiny_llama_dir), "--sets", "mt_bench"]
    base += ["--limit", "1", "--max-new-tokens", "6", "--dtype", "fp32", "--threads", "1", "--out", str(tmp_path)]
    done = subprocess.run([*base, "--ngram", "--ngram-sizes", "1,3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["draft"] == "prompt lookup (ngram 1..3)"
    assert (results["settings"]["ngram_min"], results["settings"]["ngram_max"]) == (1, 3)
    assert results["sets"][0]["outputs_differing"] == 0 and results["sets"][0]["lookup"] is None

    # Two drafts of one name and prompt lookup, against one plain baseline: a report each, and a table of all.
    other = favoured_draft(target, seed=1)
    for directory, model in ((tmp_path / "a" / "draft", draft), (tmp_path / "b" / "draft", other)):
        write_draft(directory, model.trainable_state_dict(), model.config)
    drafts = ["--draft", str(tmp_path / "a" / "draft"), "--draft", str(tmp_path / "b" / "draft")]
    base[-1] = str(tmp_path / "side")
    done = subprocess.run([*base, *drafts, "--ngram"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = {
        label: json.loads((tmp_path / "side" / label / "results.json").read_text())
        for label in ("a-draft", "b-draft", "ngram")
    }
    assert (
        reports["a-draft"]["draft"] == str(tmp_path / "a" / "draft") and reports["ngram"]["sets"][0]["lookup"] is None
    )
    sets = [report["sets"][0] for report in reports.values()]
    assert len({s["greedy_tokens_per_s"] for s in sets}) == 1  # one plain run
    assert all(s["outputs_differing"] == 0 for s in sets)
    table = (tmp_path / "side" / "results.md").read_text()
    for label, s in zip(reports, sets):
        assert f"| mt_bench | {label} | {s['acceptance_length']:.3f} |" in table
    assert table in done.stdout
    shifted = tmp_path / "shifted"
    write_draft(shifted, other.trainable_state_dict(), dataclasses.replace(other.config, aux_layer_ids=[0, 1, 2]))
    refused = subprocess.run([*base, *drafts[:2], "--draft", str(shifted)], capture_output=True, text=True)
    assert refused.returncode == 2 and "drafts measured side by side must read the same layers" in refused.stderr
    refusals = (
        ([], "error: give a draft (--draft PATH, repeatable), --ngram, or both"),
        (["--ngram", "--ngram-sizes", "2"], "error: --ngram-sizes '2': expected MIN,MAX, e.g. 2,4"),
        (["--ngram", "--ngram-sizes", "3,2"], "error: --ngram-sizes '3,2': need 1 <= MIN <= MAX"),
        (["--ngram", "--batch-size", "2"], "error: prompt lookup drafts a chain, one prompt at a time"),
    )
    for extra, message in refusals:
        refused = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2 and refused.stderr.strip().startswith(message), refused.stderr[-2000:]
        assert refused.stderr.strip().count("\n") == 0  # one line
