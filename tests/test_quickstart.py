"""The quickstart's closing measurement, on a tiny target: one `wingspan eval` report per chain length (one
plain baseline for all), and the lines it prints name the fastest chain length and the command that measures
more."""

import json

import pytest
from test_eval_runner import draft, target  # noqa: F401

from wingspan.export import ExportSettings, export_draft
from wingspan.quickstart import fastest, measure_draft, measurement_lines

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_closing_measurement_reports_each_chain_length(target, draft, tmp_path):  # noqa: F811
    export_draft(draft, tmp_path / "vllm-draft", "vllm", ExportSettings(dtype="float32"))
    check = dict(prompt_set="mt_bench", limit=2, max_new_tokens=8, chain_lengths=(1, 3))
    measured = measure_draft(target, tmp_path / "vllm-draft", tmp_path / "eval", "float32", **check)
    assert sorted(measured) == [1, 3]
    assert measured[1].greedy_tokens_per_s == measured[3].greedy_tokens_per_s  # one plain baseline for both
    for k, result in measured.items():
        saved = json.loads((tmp_path / "eval" / f"k{k}" / "results.json").read_text())
        assert saved["settings"]["num_draft_tokens"] == k and saved["sets"][0]["num_prompts"] == 2
        assert saved["settings"]["first_turns"] and [len(p["prompt_tokens"]) for p in saved["sets"][0]["prompts"]] == [
            1,
            1,
        ]
        assert saved["sets"][0]["acceptance_length"] == result.acceptance_length
        assert result.outputs_differing == 0 and len(result.acceptance_per_position) == k
    text = measurement_lines(measured, tmp_path / "vllm-draft", tmp_path / "eval", "float32", check)
    best = fastest(measured)
    assert measured[best].speedup == max(r.speedup for r in measured.values())
    assert f"fastest in wingspan's engine here: {best} per round" in text
    assert f"--num-draft-tokens {best} --first-turns --out {tmp_path / 'eval' / 'full'}" in text
    for k, result in measured.items():
        assert f"  {k} draft token(s) per round: tau {result.acceptance_length:.2f}" in text
