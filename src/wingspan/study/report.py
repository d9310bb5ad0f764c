"""The study's results: results.json (every figure), report.md (tables, fits, what they say) and two plots.

Across prompt sets, tau is pooled as the evaluation pools it within a set (all tokens over all rounds), and
the speedup as all speculative tokens/s over all plain tokens/s. A pooled tau comes with a 95% prompt
bootstrap interval (prompts resampled within their set), and first vs all at one depth with a paired one
(the same prompts resampled for both), so a difference smaller than the sampling noise is called that.
Rewritten after every setting, so a long study shows what it has measured so far.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from wingspan.config import to_dict
from wingspan.files import write_text_atomically
from wingspan.plots import agg_figure, save_png
from wingspan.study.config import SettingResult, StudyConfig
from wingspan.study.fit import LogFit, bootstrap_interval, fit_log_linear, log_slope, prompts_tau

POOLED = "all sets"


@dataclass
class FitRow:
    decoder: str
    injection: str
    prompt_set: str
    depths: list[int]
    taus: list[float]
    fit: LogFit
    # b refitted over prompt resamples (the same prompts for every depth): the measurement noise that the
    # fit's own interval, from the scatter around the line, does not see
    b_prompt_interval: tuple[float, float] | None


def set_strata(row: SettingResult, decoder: str) -> list[list[tuple[int, int]]]:
    """(rounds, accepted drafts) of every prompt this setting was evaluated on, one list per prompt set."""
    strata = [
        [(rounds, accepted) for _, rounds, accepted in prompts] for prompts in row.prompts.get(decoder, {}).values()
    ]
    return [s for s in strata if s]


def pooled_tau(row: SettingResult, decoder: str) -> float | None:
    return prompts_tau([prompt for stratum in set_strata(row, decoder) for prompt in stratum])


def pooled_speedup(sets: dict[str, dict[str, Any]]) -> float | None:
    """Speculative over plain tokens/s pooled over `sets`; None when a set has no times (replayed)."""
    if not sets or any(
        r.get(rate) is None for r in sets.values() for rate in ("spec_tokens_per_s", "greedy_tokens_per_s")
    ):
        return None
    spec_s = sum(r["new_tokens"] / r["spec_tokens_per_s"] for r in sets.values())
    greedy_s = sum(r["greedy_new_tokens"] / r["greedy_tokens_per_s"] for r in sets.values())
    return (sum(r["new_tokens"] for r in sets.values()) / spec_s) / (
        sum(r["greedy_new_tokens"] for r in sets.values()) / greedy_s
    )


def tau_of(row: SettingResult, decoder: str, prompt_set: str) -> float | None:
    sets = row.eval.get(decoder, {})
    if prompt_set == POOLED:
        return pooled_tau(row, decoder)
    return sets[prompt_set]["acceptance_length"] if prompt_set in sets else None


def tau_interval(row: SettingResult, decoder: str) -> tuple[float, float] | None:
    """95% bootstrap interval of the pooled tau over the prompts this setting was evaluated on."""
    strata = set_strata(row, decoder)
    return bootstrap_interval(strata, prompts_tau) if strata else None


def paired_prompts(measured: list[tuple[SettingResult, str]], set_names: list[str]):
    """Each (setting, decoder)'s (rounds, accepted) by (set, prompt id), and the keys they all share, one stratum
    per set: what a paired bootstrap resamples, so that every one is measured on the same prompts."""
    per_setting = [
        {
            (name, prompt_id): (rounds, accepted)
            for name, prompts in r.prompts.get(decoder, {}).items()
            if name in set_names
            for prompt_id, rounds, accepted in prompts
        }
        for r, decoder in measured
    ]
    shared = set.intersection(*(set(p) for p in per_setting))
    strata = [[key for key in sorted(shared) if key[0] == name] for name in set_names]
    return per_setting, [keys for keys in strata if keys]


def difference_interval(
    one: tuple[SettingResult, str], other: tuple[SettingResult, str], set_names: list[str]
) -> tuple[float, float] | None:
    """95% paired bootstrap interval of tau(one) - tau(other), each a setting measured by a decoder: every
    resample draws the same prompts for both."""
    (a, b), strata = paired_prompts([one, other], set_names)
    if not strata:
        return None
    return bootstrap_interval(
        strata, lambda keys: prompts_tau([a[k] for k in keys]) - prompts_tau([b[k] for k in keys])
    )


def fits(config: StudyConfig, rows: list[SettingResult], set_names: list[str]) -> list[FitRow]:
    """tau = a + b ln D per decoder, injection series and prompt set (and pooled), where two depths or more exist."""
    out = []
    for decoder in config.decoders():
        for injection in config.injection:
            for prompt_set in [*set_names, POOLED]:
                series = [
                    r for r in rows if r.setting.in_series(injection) and tau_of(r, decoder, prompt_set) is not None
                ]
                if len({r.layers for r in series}) < 2:
                    continue
                depths, taus = [r.layers for r in series], [tau_of(r, decoder, prompt_set) for r in series]
                names = set_names if prompt_set == POOLED else [prompt_set]
                out.append(
                    FitRow(
                        decoder,
                        injection,
                        prompt_set,
                        depths,
                        taus,
                        fit_log_linear(depths, taus),
                        slope_interval(series, decoder, names),
                    )
                )
    return out


def slope_interval(series: list[SettingResult], decoder: str, set_names: list[str]) -> tuple[float, float] | None:
    """95% prompt-bootstrap interval of b: each resample draws the same prompts for every depth and refits."""
    per_setting, strata = paired_prompts([(r, decoder) for r in series], set_names)
    if not strata:
        return None
    depths = [r.layers for r in series]
    return bootstrap_interval(
        strata, lambda keys: log_slope(depths, [prompts_tau([p[k] for k in keys]) for p in per_setting])
    )


def write_study_report(config: StudyConfig, out: Path, rows: list[SettingResult]) -> None:
    set_names = list(dict.fromkeys(name for r in rows for d in r.eval.values() for name in d))
    fit_rows = fits(config, rows, set_names)
    results = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": to_dict(config),
        "settings": [to_dict(r) for r in rows],
        "fits": [to_dict(f) for f in fit_rows],
    }
    write_text_atomically(out / "results.json", json.dumps(results, indent=1) + "\n")
    write_text_atomically(out / "report.md", markdown(config, rows, set_names, fit_rows))
    plot(config, rows, fit_rows, set_names, out)


# ------------------------------------------------------------------------------------------------ markdown


def fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def markdown(config: StudyConfig, rows: list[SettingResult], set_names: list[str], fit_rows: list[FitRow]) -> str:
    tree = "tree (depth {}, top-k {}, {} tokens)".format(*config.tree)
    lines = [
        "# Layer-scaling study",
        "",
        f"- target: `{config.target}`; training data: {', '.join(f'`{d}`' for d in config.data)}",
        f"- budget: {config.budget_tokens:,} training tokens per setting; shared training fields: "
        + (", ".join(f"`{k}={v}`" for k, v in config.train.items()) or "defaults"),
        (
            f"- evaluation: replayed on the references `{config.references}` (`wingspan replay score`: exact "
            f"acceptance, no speed), sets {', '.join(set_names)}; {config.num_draft_tokens} drafts per round"
            if config.references
            else f"- evaluation: sets {', '.join(config.sets)}, {config.limit or 'all'} prompts each"
            + (" (first turns)" if config.first_turn_only else "")
            + f", greedy, up to {config.max_new_tokens} new tokens; chain of {config.num_draft_tokens} drafts "
            f"and {tree}"
        ),
        "- tau = tokens per target forward (accepted drafts + the bonus token); speedup = speculative tokens/s over "
        "plain greedy tokens/s, measured side by side; draft cost = seconds per drafted token over seconds per "
        "plain-decoded token",
        "",
    ]
    titles = {
        "chain": f"chain of {config.num_draft_tokens}",
        "tree": tree,
        "parallel": f"parallel, {config.num_draft_tokens} drafts from one forward",
    }
    for decoder in config.decoders():
        lines += [f"## Acceptance length and speedup: {titles[decoder]}", ""]
        header = ["setting", "D", "injection", "parameters", "draft cost", *set_names, POOLED, "95% CI", "speedup"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for r in (r for r in rows if decoder in r.eval):
            sets = r.eval[decoder]
            cells = [
                r.name,
                str(r.layers),
                "both" if r.layers == 1 else r.injection,
                f"{r.parameters / 1e6:.1f} M",
                fmt(r.draft_cost.get(decoder), 3),
                *(fmt(tau_of(r, decoder, s)) for s in set_names),
                fmt(pooled_tau(r, decoder)),
                interval_text(tau_interval(r, decoder)),
                fmt(pooled_speedup(sets), 2, "x"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "## Acceptance per draft position (chain or parallel, pooled over sets)",
        "",
        "| setting | " + " | ".join(f"position {j}" for j in range(config.num_draft_tokens)) + " |",
        "|---|" + "---|" * config.num_draft_tokens,
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | " + " | ".join(fmt(v, 3) for v in pooled_positions(r, config.num_draft_tokens)) + " |"
        )
    lines += [
        "",
        "## Fit: tau = a + b ln D",
        "",
        "| decoder | injection | set | depths | a | b | 95% CI of b over depths | over prompts | "
        "gain per doubling | R^2 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in fit_rows:
        lines.append(
            f"| {f.decoder} | {f.injection} | {f.prompt_set} | {','.join(map(str, f.depths))} | {f.fit.a:.3f} | "
            f"{f.fit.b:.3f} | {interval_text(f.fit.b_interval, 3)} | {interval_text(f.b_prompt_interval, 3)} | "
            f"{f.fit.b * math.log(2):+.3f} | {fmt(f.fit.r2, 3)} |"
        )
    lines += ["", "## What the fits say (pooled over sets)", ""]
    lines += [verdict(f) for f in fit_rows if f.prompt_set == POOLED]
    lines += injection_verdicts(rows, set_names)
    lines += mode_verdicts(rows, set_names, config.num_draft_tokens)
    lines += [
        "",
        "## Training",
        "",
        "| setting | final loss_0 | "
        + " | ".join(f"acc_{j}" for j in range(steps(rows)))
        + " | simulated tau | train tok/s |",
        "|---|---|" + "---|" * (steps(rows) + 2),
    ]
    for r in rows:
        accs = " | ".join(fmt(r.train_final.get(f"acc_{j}"), 3) for j in range(steps(rows)))
        lines.append(
            f"| {r.name} | {fmt(r.train_final.get('loss_0'), 3)} | {accs} | "
            f"{fmt(r.train_final.get('sim_accept_len'))} | {fmt(r.train_tokens_per_s, 0)} |"
        )
    return "\n".join(lines) + "\n"


def interval_text(interval: tuple[float, float] | None, digits: int = 2) -> str:
    return "n/a" if interval is None else f"[{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"


def steps(rows: list[SettingResult]) -> int:
    return max((sum(k.startswith("acc_") for k in r.train_final) for r in rows), default=0)


def pooled_positions(row: SettingResult, positions: int) -> list[float | None]:
    """Acceptance per draft position of the setting's chain (or parallel) decoder, pooled over sets by the rounds
    that proposed it."""
    sets = row.eval.get(row.setting.decoders[0], {}).values()
    rates = []
    for j in range(positions):
        weighted = [
            (s["acceptance_per_position"][j], s["rounds"]) for s in sets if len(s["acceptance_per_position"]) > j
        ]
        total = sum(n for _, n in weighted)
        rates.append(sum(rate * n for rate, n in weighted) / total if total else None)
    return rates


def verdict(f: FitRow) -> str:
    """A plain reading of one fit: is tau rising with ln D, beyond both the scatter around the line and the
    prompt sampling noise, and is the straight line a good description?"""
    head = f"- {f.decoder}, embeddings into {f.injection}, D in {{{', '.join(map(str, f.depths))}}}: "
    over_prompts = f"95% CI over prompts {interval_text(f.b_prompt_interval, 3)}"
    if f.fit.b_interval is None:
        return head + f"b = {f.fit.b:.3f} ({over_prompts}) from two depths only: no test of the shape."
    intervals = [f.fit.b_interval, *([f.b_prompt_interval] if f.b_prompt_interval else [])]
    both = f"95% CI over depths {interval_text(f.fit.b_interval, 3)}, {over_prompts}"
    if all(low > 0 for low, _ in intervals):
        rise = f"tau rises with depth (b = {f.fit.b:.3f}; {both}: 0 excluded)"
    elif all(high < 0 for _, high in intervals):
        rise = f"tau falls with depth (b = {f.fit.b:.3f}; {both}: 0 excluded)"
    else:
        rise = f"no significant trend (b = {f.fit.b:.3f}; {both}: 0 inside at least one)"
    if f.fit.r2 is None:
        return head + rise + "; tau is the same at every depth."
    shape = ", the log-linear form fits well" if f.fit.r2 >= 0.8 else ", a poor log-linear fit"
    return head + rise + f"; R^2 = {f.fit.r2:.2f}{shape}."


def injection_verdicts(rows: list[SettingResult], set_names: list[str]) -> list[str]:
    """first vs all at each depth (and drafting mode) where both exist: the pooled tau difference of the chain
    (or parallel) decoder and whether the prompt sample can tell them apart."""
    by_key = {(r.mode, r.layers, r.injection): r for r in rows}
    lines = []
    for mode, depth in sorted({(r.mode, r.layers) for r in rows if r.layers > 1}):
        first, every = by_key.get((mode, depth, "first")), by_key.get((mode, depth, "all"))
        if not first or not every:
            continue
        decoder = first.setting.decoders[0]
        a, b = pooled_tau(first, decoder), pooled_tau(every, decoder)
        if a is None or b is None:
            continue
        line = (
            f"- D = {depth}, {mode} drafts: {decoder} tau {a:.3f} with embeddings into the first layer, {b:.3f} into "
            f"all ({'first' if a > b else 'all'} ahead by {abs(a - b):.3f}"
        )
        lines.append(
            line + paired_text(difference_interval((first, decoder), (every, decoder), set_names), "first - all") + ")"
        )
    return lines


def mode_verdicts(rows: list[SettingResult], set_names: list[str], k: int) -> list[str]:
    """parallel vs chain drafting at each depth and injection where both exist: the same K drafts per round
    from one forward or from K, their pooled tau and its paired difference."""
    by_key = {(r.mode, r.layers, r.injection): r for r in rows}
    lines = []
    for depth, injection in sorted({(r.layers, r.injection) for r in rows}):
        chain, parallel = by_key.get(("chain", depth, injection)), by_key.get(("parallel", depth, injection))
        if not chain or not parallel:
            continue
        a, b = pooled_tau(parallel, "parallel"), pooled_tau(chain, "chain")
        if a is None or b is None:
            continue
        interval = difference_interval((parallel, "parallel"), (chain, "chain"), set_names)
        lines.append(
            f"- {parallel.name} vs {chain.name}: {k} drafts per round, tau {a:.3f} from one forward, {b:.3f} from {k} "
            f"({'parallel' if a > b else 'chain'} ahead by {abs(a - b):.3f}"
            + paired_text(interval, "parallel - chain")
            + ")"
        )
    return lines


def paired_text(interval: tuple[float, float] | None, what: str) -> str:
    if interval is None:
        return ""
    low, high = interval
    meaning = "within the sampling noise" if low <= 0 <= high else "larger than the sampling noise"
    return f"; {what} 95% paired CI [{low:+.3f}, {high:+.3f}], {meaning}"


# ------------------------------------------------------------------------------------------------ plots


def plot(
    config: StudyConfig, rows: list[SettingResult], fit_rows: list[FitRow], set_names: list[str], out: Path
) -> None:
    styles = {"first": ("tab:blue", "o"), "all": ("tab:orange", "s")}
    figure = agg_figure(figsize=(11, 4.2))
    decoders = config.decoders()
    axes = figure.subplots(1, len(decoders), sharey=True, squeeze=False)[0]
    for axis, decoder in zip(axes, decoders):
        for injection in config.injection:
            colour, marker = styles[injection]
            series = [(r.layers, tau_of(r, decoder, POOLED)) for r in rows if r.setting.in_series(injection)]
            series = sorted((d, t) for d, t in series if t is not None)
            if not series:
                continue
            axis.plot(
                *zip(*series), marker=marker, color=colour, linestyle="none", label=f"embeddings into {injection}"
            )
            for f in fit_rows:
                if (f.decoder, f.injection, f.prompt_set) == (decoder, injection, POOLED):
                    grid = [1 + i * (max(f.depths) - 1) / 50 for i in range(51)]
                    axis.plot(
                        grid,
                        [f.fit.predict(d) for d in grid],
                        color=colour,
                        linestyle="--",
                        linewidth=1,
                        label=f"fit {f.fit.a:.2f} {f.fit.b:+.3f} ln D (R² {fmt(f.fit.r2)})",
                    )
        axis.set_xscale("log")
        depths = sorted({r.layers for r in rows}) or [1]
        axis.set_xticks(depths, [str(d) for d in depths])
        axis.minorticks_off()
        axis.set_xlabel("draft decoder layers D (log scale)")
        axis.set_title(f"{decoder}: tau pooled over {', '.join(set_names)}", fontsize=9)
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:  # a decoder none of whose settings has finished has no lines yet
            axis.legend(fontsize=7)
    axes[0].set_ylabel("acceptance length tau")
    save_png(figure, out / "tau_vs_depth.png")
    if config.references:  # replayed: no speed
        return

    figure = agg_figure(figsize=(6.5, 4.2))
    axis = figure.add_subplot()
    for decoder, linestyle in zip(decoders, ("-", ":", "--")):
        for injection in config.injection:
            colour, marker = styles[injection]
            series = [
                (r.layers, pooled_speedup(r.eval.get(decoder, {}))) for r in rows if r.setting.in_series(injection)
            ]
            series = sorted((d, s) for d, s in series if s is not None)
            if series:
                axis.plot(
                    *zip(*series), marker=marker, color=colour, linestyle=linestyle, label=f"{decoder}, {injection}"
                )
    axis.axhline(1.0, color="grey", linewidth=1)
    axis.set_xlabel("draft decoder layers D")
    axis.set_ylabel("speedup over plain decoding")
    axis.set_title("end-to-end speedup (batch 1, this machine)", fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    save_png(figure, out / "speedup_vs_depth.png")
