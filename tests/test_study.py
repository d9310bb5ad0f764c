"""The layer-scaling study: the log-linear fit, the prompt bootstrap, the config checks, and a whole tiny study
that resumes."""

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch

from wingspan.errors import ConfigError
from wingspan.eval.prompts import load_prompt_sets
from wingspan.eval.replay import build_references, replay
from wingspan.eval.runner import load_draft
from wingspan.pipeline import load_target
from wingspan.study import layers as study_layers
from wingspan.study.config import StudyConfig
from wingspan.study.fit import bootstrap_interval, fit_log_linear, log_slope, prompts_tau, t_cdf, t_quantile
from wingspan.study.layers import open_study, run_study

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------ fit


@pytest.mark.parametrize(("df", "quantile"), [(1, 12.7062), (3, 3.1824), (4, 2.7764), (10, 2.2281), (30, 2.0423)])
def test_t_quantile_matches_the_table(df, quantile):
    assert t_quantile(0.975, df) == pytest.approx(quantile, abs=2e-4)
    assert t_cdf(quantile, df) == pytest.approx(0.975, abs=1e-5)


def test_fit_recovers_an_exact_log_line():
    depths = [1, 2, 3, 4, 6]
    fit = fit_log_linear(depths, [1.3 + 0.2 * math.log(d) for d in depths])
    assert (fit.a, fit.b, fit.r2) == (pytest.approx(1.3), pytest.approx(0.2), pytest.approx(1.0))
    assert fit.b_interval == (pytest.approx(0.2), pytest.approx(0.2))
    assert fit.predict(8) == pytest.approx(1.3 + 0.2 * math.log(8))


def test_fit_interval_is_the_textbook_one():
    # Worked by hand: x = ln D; b = Sxy / Sxx; s^2 = SSE / (n - 2); half-width t_{0.975, 3} * sqrt(s^2 / Sxx).
    depths, taus = [1, 2, 3, 4, 6], [1.30, 1.45, 1.44, 1.55, 1.57]
    xs = [math.log(d) for d in depths]
    mx, my = sum(xs) / 5, sum(taus) / 5
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, taus)) / sxx
    sse = sum((y - (my - b * mx) - b * x) ** 2 for x, y in zip(xs, taus))
    half = 3.182446 * math.sqrt(sse / 3 / sxx)
    fit = fit_log_linear(depths, taus)
    assert fit.b == pytest.approx(b)
    assert fit.b_interval == (pytest.approx(b - half, abs=1e-5), pytest.approx(b + half, abs=1e-5))
    assert fit.r2 == pytest.approx(1 - sse / sum((y - my) ** 2 for y in taus))
    assert 0 < fit.r2 < 1


def test_fit_needs_two_depths_and_gives_no_interval_for_two():
    with pytest.raises(ValueError, match="two distinct depths"):
        fit_log_linear([2, 2], [1.2, 1.3])
    fit = fit_log_linear([1, 4], [1.2, 1.5])
    assert fit.b_interval is None and fit.r2 is None and fit.b == pytest.approx(0.3 / math.log(4))


def test_log_slope_is_the_fits_b():
    depths, taus = [1, 2, 3, 4, 6], [1.40, 1.46, 1.44, 1.52, 1.55]
    assert log_slope(depths, taus) == pytest.approx(fit_log_linear(depths, taus).b)


def test_prompts_tau_pools_all_rounds():
    assert prompts_tau([(10, 5), (30, 3)]) == pytest.approx(1 + 8 / 40)


def test_bootstrap_interval_brackets_the_estimate_and_shrinks_with_more_prompts():
    # Per-prompt (rounds, accepted): tau 1.1 to 1.6, pooled 1.35 either way.
    prompts = [(100, 10), (100, 60), (100, 30), (100, 40)]
    low, high = bootstrap_interval([prompts], prompts_tau)
    assert low < prompts_tau(prompts) < high and 1.1 <= low and high <= 1.6
    assert bootstrap_interval([prompts], prompts_tau) == (low, high)  # seeded: the same report every time
    wide_low, wide_high = low, high
    low, high = bootstrap_interval([prompts * 8], prompts_tau)
    assert high - low < (wide_high - wide_low) / 2  # 8x the prompts: about 1/sqrt(8) the width
    assert bootstrap_interval([[(50, 20)] * 5], prompts_tau) == (pytest.approx(1.4), pytest.approx(1.4))


def test_paired_bootstrap_separates_a_real_difference_from_noise():
    def difference(pairs):
        return prompts_tau([a for a, _ in pairs]) - prompts_tau([b for _, b in pairs])

    # Prompts vary a lot (hard and easy), but the first draft accepts 5 more tokens per 100 rounds on every one.
    pairs = [((100, base + 5), (100, base)) for base in (5, 50, 20, 80, 35)]
    low, high = bootstrap_interval([pairs], difference)
    assert 0 < low <= 0.05 <= high
    # The same per-prompt spread with no consistent sign: the interval straddles 0.
    pairs = [((100, 50), (100, 40)), ((100, 10), (100, 25)), ((100, 30), (100, 30)), ((100, 60), (100, 55))]
    low, high = bootstrap_interval([pairs], difference)
    assert low < 0 < high
    with pytest.raises(ValueError, match="at least one item"):
        bootstrap_interval([pairs, []], difference)


# ------------------------------------------------------------------------------------------------ config


def test_config_errors_name_the_field(tmp_path):
    good = dict(data=["a.jsonl"], budget_tokens=1000)
    with pytest.raises(ConfigError, match="layers"):
        StudyConfig(**good, layers=[0, 2])
    with pytest.raises(ConfigError, match="injection"):
        StudyConfig(**good, injection=["middle"])
    with pytest.raises(ConfigError, match=r"num_hidden_layers.*set by the study"):
        StudyConfig(**good, train={"num_hidden_layers": 3})
    with pytest.raises(ConfigError, match="unknown field.*ttt_stepz"):
        StudyConfig(**good, train={"ttt_stepz": 3})
    with pytest.raises(ConfigError, match="tree"):
        StudyConfig(**good, tree=[2, 4, 64])  # 64 nodes cannot fit a depth-2, top-4 tree
    with pytest.raises(ConfigError, match=r"modes: distinct values among \['chain', 'parallel'\]"):
        StudyConfig(**good, modes=["tree"])
    with pytest.raises(ConfigError, match=r"draft_mode.*set by the study"):
        StudyConfig(**good, train={"draft_mode": "parallel"})
    with pytest.raises(ConfigError, match="a parallel draft drafts at least 2 tokens per forward"):
        StudyConfig(**good, modes=["parallel"], num_draft_tokens=1)


def test_a_study_directory_refuses_a_different_study_but_grows(tmp_path):
    config = StudyConfig(data=["a.jsonl"], budget_tokens=1000, layers=[1, 2])
    open_study(config, tmp_path)
    open_study(StudyConfig(data=["a.jsonl"], budget_tokens=1000, layers=[1, 2, 3], sets=["gsm8k"]), tmp_path)
    with pytest.raises(ConfigError, match="budget_tokens=1000"):
        open_study(StudyConfig(data=["a.jsonl"], budget_tokens=2000), tmp_path)
    with pytest.raises(ConfigError, match="train="):
        open_study(StudyConfig(data=["a.jsonl"], budget_tokens=1000, train={"lr": 0.1}), tmp_path)


def test_grid_trains_depth_one_once():
    config = StudyConfig(data=["a.jsonl"], budget_tokens=1000, layers=[3, 1, 2], injection=["first", "all"])
    assert [s.name for s in config.settings()] == ["D1", "D2-first", "D2-all", "D3-first", "D3-all"]
    assert all(s.in_series("all") for s in config.settings() if s.name in ("D1", "D2-all", "D3-all"))
    both = StudyConfig(
        data=["a.jsonl"], budget_tokens=1000, layers=[1, 2], injection=["first"], modes=["chain", "parallel"]
    )
    assert [(s.name, s.mode, s.decoders) for s in both.settings()] == [
        ("D1", "chain", ("chain", "tree")),
        ("D2-first", "chain", ("chain", "tree")),
        ("P-D1", "parallel", ("parallel",)),
        ("P-D2-first", "parallel", ("parallel",)),
    ]


# ------------------------------------------------------------------------------------------------ a whole study


@pytest.fixture(scope="module")
def tiny_study(tiny_llama_dir, counting_chat, tmp_path_factory):
    """A 3-setting study (D = 1, 2 with both injections) on the tiny target, run once for the module."""
    out = tmp_path_factory.mktemp("study")
    prompts = out / "prompts.txt"
    prompts.write_text("Count from 3 to 9, please.\nCount from 10 to 14, please.\n")
    config = StudyConfig(
        target=str(tiny_llama_dir),
        data=[str(counting_chat(16, spread=4))],
        budget_tokens=1500,
        layers=[1, 2],
        injection=["first", "all"],
        sets=[f"counting={prompts}"],
        limit=2,
        tree=[2, 2, 4],
        max_new_tokens=8,
        train=dict(
            target_dtype="float32",
            draft_vocab_size=64,
            max_length=64,
            batch_tokens=256,
            ttt_steps=2,
            lr=1e-3,
            log_every=1,
            save_every=2,
        ),
    )
    run_study(config, out)
    return config, out


def test_every_setting_trains_on_the_same_budget_and_is_evaluated(tiny_study):
    config, out = tiny_study
    results = json.loads((out / "results.json").read_text())
    assert [s["name"] for s in results["settings"]] == ["D1", "D2-first", "D2-all"]
    dump_tokens = json.loads((out / "shared/dump/manifest.json").read_text())
    dump_tokens = sum(s["num_tokens"] for s in dump_tokens["shards"])
    runs = {
        s["name"]: json.loads((out / "settings" / s["name"] / "run/config.json").read_text())
        for s in results["settings"]
    }
    assert {r["epochs"] for r in runs.values()} == {1500 / dump_tokens}
    assert {r["from_dump"] for r in runs.values()} == {str(out / "shared/dump")}
    assert [(r["num_hidden_layers"], r["embed_injection"]) for r in runs.values()] == [
        (1, "first"),
        (2, "first"),
        (2, "all"),
    ]
    metrics = {name: (out / "settings" / name / "run/metrics.jsonl").read_text().splitlines() for name in runs}
    steps = {name: json.loads(lines[-1])["step"] for name, lines in metrics.items()}
    assert len(set(steps.values())) == 1  # same schedule

    by_name = {s["name"]: s for s in results["settings"]}
    assert by_name["D2-all"]["parameters"] > by_name["D2-first"]["parameters"] > by_name["D1"]["parameters"]
    for setting in results["settings"]:
        for decoder in ("chain", "tree"):
            counting = setting["eval"][decoder]["counting"]
            assert counting["num_prompts"] == 2 and counting["outputs_differing"] == 0
            assert counting["acceptance_length"] >= 1
            assert setting["draft_cost"][decoder] > 0
        assert len(setting["eval"]["chain"]["counting"]["acceptance_per_position"]) == 3
    # Two depths per series: each (decoder, injection, set) has a fit through them, without an interval.
    keys = {(f["decoder"], f["injection"], f["prompt_set"]) for f in results["fits"]}
    assert keys == {(d, i, s) for d in ("chain", "tree") for i in ("first", "all") for s in ("counting", "all sets")}
    d1, d2 = by_name["D1"]["eval"]["chain"]["counting"], by_name["D2-all"]["eval"]["chain"]["counting"]
    fit = next(
        f for f in results["fits"] if (f["decoder"], f["injection"], f["prompt_set"]) == ("chain", "all", "counting")
    )
    assert fit["fit"]["b"] == pytest.approx((d2["acceptance_length"] - d1["acceptance_length"]) / math.log(2))

    report = (out / "report.md").read_text()
    assert "| D2-all | 2 | all |" in report and "## Fit: tau = a + b ln D" in report
    assert "| all sets | 95% CI | speedup |" in report and "first - all 95% paired CI" in report
    assert "| 95% CI of b over depths | over prompts |" in report and "95% CI over prompts [" in report
    assert all(low <= f["fit"]["b"] <= high for f in results["fits"] for low, high in [f["b_prompt_interval"]])
    prompt_ids = {name: [p[0] for p in by_name[name]["prompts"]["chain"]["counting"]] for name in by_name}
    assert len(prompt_ids["D1"]) == 2 and prompt_ids["D1"] == prompt_ids["D2-all"]  # paired by prompt
    for png in ("tau_vs_depth.png", "speedup_vs_depth.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_study_of_chain_and_parallel_drafts(tiny_study, tmp_path):
    """Parallel settings train P-EAGLE drafts of the chain's K (the shared chain unroll left to chain drafts),
    are measured by their own decoder, and the report sets each against the chain draft of its shape."""
    config, _ = tiny_study
    both = StudyConfig(**{**config.__dict__, "layers": [1], "injection": ["first"], "modes": ["chain", "parallel"]})
    run_study(both, tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    by_name = {s["name"]: s for s in results["settings"]}
    assert list(by_name) == ["D1", "P-D1"] and by_name["P-D1"]["mode"] == "parallel"
    run = json.loads((tmp_path / "settings/P-D1/run/config.json").read_text())
    assert (run["draft_mode"], run["num_parallel_tokens"], run["ttt_steps"]) == ("parallel", 3, 3)
    assert json.loads((tmp_path / "settings/D1/run/config.json").read_text())["ttt_steps"] == 2
    parallel = by_name["P-D1"]["eval"]
    assert list(parallel) == ["parallel"] and list(by_name["D1"]["eval"]) == ["chain", "tree"]
    counting = parallel["parallel"]["counting"]
    assert counting["outputs_differing"] == 0 and len(counting["acceptance_per_position"]) == 3
    report = (tmp_path / "report.md").read_text()
    assert "## Acceptance length and speedup: parallel, 3 drafts from one forward" in report
    tau = counting["acceptance_length"]
    assert f"- P-D1 vs D1: 3 drafts per round, tau {tau:.3f} from one forward" in report
    assert "parallel - chain 95% paired CI [" in report


def test_a_study_replayed_on_references_scores_each_draft_as_replay_does(tiny_study, tmp_path, monkeypatch):
    """With references, chain and parallel settings are scored on the references' replies (no tree, no speed):
    each figure is `replay`'s for that draft in the references' dtype (here float32, while the study's target
    runs in bf16); references of another target are refused before any training."""
    config, _ = tiny_study
    target = load_target(config.base_train_config())
    sets = load_prompt_sets(config.sets, config.limit)
    references = build_references(target, config.target, "float32", sets, config.max_new_tokens, True)
    path = tmp_path / "refs.safetensors"
    references.save(path)
    grid = {"layers": [1], "injection": ["first"], "modes": ["chain", "parallel"], "references": str(path)}
    grid |= {"train": {**config.train, "target_dtype": "bfloat16"}}
    scored, real_replay = [], study_layers.replay
    monkeypatch.setattr(
        study_layers,
        "replay",
        lambda draft, *args: scored.append(draft.embed_tokens.weight) or real_replay(draft, *args),
    )
    run_study(StudyConfig(**{**config.__dict__, **grid}), tmp_path / "study")
    assert [weight.dtype for weight in scored] == [torch.float32] * 2
    assert all(torch.equal(weight, target.embed_weight()) for weight in scored)

    out = tmp_path / "study"
    by_name = {s["name"]: s for s in json.loads((out / "results.json").read_text())["settings"]}
    assert {name: list(s["eval"]) for name, s in by_name.items()} == {"D1": ["chain"], "P-D1": ["parallel"]}
    for name, decoder in (("D1", "chain"), ("P-D1", "parallel")):
        (expected,) = replay(load_draft(out / "settings" / name / "run/draft", target), references, 3)
        measured = by_name[name]["eval"][decoder]["counting"]
        assert measured["acceptance_length"] == expected.acceptance_length
        assert measured["acceptance_per_position"] == expected.acceptance_per_position
        assert by_name[name]["prompts"][decoder]["counting"] == [[p.id, p.rounds, p.accepted] for p in expected.prompts]
        assert by_name[name]["draft_cost"][decoder] is None
    report = (out / "report.md").read_text()
    assert f"replayed on the references `{path}`" in report and "| n/a |" in report
    assert "parallel - chain 95% paired CI [" in report
    assert (out / "tau_vs_depth.png").exists() and not (out / "speedup_vs_depth.png").exists()

    dataclasses.replace(references, target="another").save(tmp_path / "another.safetensors")
    other = StudyConfig(**{**config.__dict__, **grid, "references": str(tmp_path / "another.safetensors")})
    with pytest.raises(ConfigError, match=r"references of target 'another'; the study trains for"):
        run_study(other, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()  # nothing written: the corrected command starts afresh


def test_rerun_retrains_and_reevaluates_nothing_and_extends_the_grid(tiny_study, monkeypatch):
    config, out = tiny_study
    trained, evaluated = [], []
    real_train, real_evaluate = study_layers.train_setting, study_layers.evaluate

    def spy_train(train_config, target):
        trained.append(train_config.output_dir)
        return real_train(train_config, target)

    def spy_evaluate(*args, **kwargs):
        evaluated.append(kwargs["name"])
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(study_layers, "train_setting", spy_train)
    monkeypatch.setattr(study_layers, "evaluate", spy_evaluate)
    monkeypatch.setattr(
        "wingspan.pipeline.run_training", lambda *a, **k: pytest.fail("a finished setting was retrained")
    )
    run_study(config, out)
    assert len(trained) == 3 and evaluated == []

    monkeypatch.undo()
    monkeypatch.setattr(study_layers, "evaluate", spy_evaluate)
    grown = StudyConfig(**{**config.__dict__, "layers": [1, 2, 3], "injection": ["first", "all"]})
    run_study(grown, out)
    assert evaluated == [f"D3-{mode} {decoder} counting" for mode in ("first", "all") for decoder in ("chain", "tree")]
    results = json.loads((out / "results.json").read_text())
    assert [s["name"] for s in results["settings"]] == ["D1", "D2-first", "D2-all", "D3-first", "D3-all"]
    assert all(f["fit"]["b_interval"] is not None for f in results["fits"])  # three depths: intervals now


def test_cli_runs_a_study_and_reports_bad_options(tmp_path, tiny_study):
    config, _ = tiny_study
    command = [
        sys.executable,
        "-m",
        "wingspan",
        "study",
        "layers",
        "--data",
        config.data[0],
        "--budget-tokens",
        "600",
        "--out",
        str(tmp_path / "s"),
        "--target",
        config.target,
        "--layers",
        "1",
        "--injection",
        "first",
        "--sets",
        config.sets[0],
        "--limit",
        "1",
        "--tree",
        "2,2,4",
        "--max-new-tokens",
        "4",
        "--threads",
        "1",
        *(f"{k}={v}" for k, v in config.train.items()),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "report:" in done.stdout and (tmp_path / "s/report.md").exists()
    bad = subprocess.run(
        [*command[: -len(config.train)], "num_hidden_layers=3"], capture_output=True, text=True, timeout=600
    )
    assert bad.returncode == 2 and "set by the study itself" in bad.stderr and "Traceback" not in bad.stderr
    assert (
        subprocess.run([sys.executable, "-m", "wingspan", "study", "layers", "--help"], capture_output=True).returncode
        == 0
    )
