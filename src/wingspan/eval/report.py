"""The files of a `wingspan eval` run: results.json (everything, per prompt too), results.md (one table row per
set) and acceptance.png (acceptance per draft position, one line per set). Each is written to a temporary
name and renamed, so an interrupted run never leaves a half-written file behind.
"""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from wingspan.config import to_dict
from wingspan.devices import describe
from wingspan.eval.runner import EvalSettings, SetResult
from wingspan.files import write_text_atomically
from wingspan.plots import agg_figure, require_matplotlib, save_png

COLUMNS = (
    "set",
    "prompts",
    "tau",
    "acceptance per position",
    "accepted/round",
    "spec tok/s",
    "greedy tok/s",
    "speedup",
    "outputs differing",
)


def write_report(
    out_dir: str | Path,
    sets: list[SetResult],
    settings: EvalSettings,
    *,
    target: str,
    draft: str,
    dtype: str,
    device: torch.device,
) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "target": target,
        "draft": draft,
        "dtype": dtype,
        "settings": to_dict(settings),
        "environment": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "device": describe(device),
        },
        "sets": [to_dict(result) for result in sets],
    }
    write_text_atomically(out_dir / "results.json", json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    text = markdown(sets, settings, target=target, draft=draft, dtype=dtype, device=device)
    write_text_atomically(out_dir / "results.md", text)
    plot_acceptance(sets, out_dir / "acceptance.png")


def decoding(settings: EvalSettings) -> str:
    tree = settings.tree
    drafts = (
        f"tree (depth {tree.depth}, top-k {tree.top_k}, {tree.total_tokens} tokens)"
        if tree
        else f"chain of {settings.num_draft_tokens} drafts"
    )
    sampling = f"temperature {settings.temperature:g}" if settings.temperature > 0 else "greedy"
    batch = f", batches of {settings.batch_size} prompts" if settings.batch_size > 1 else ""
    held_out = f", prompts found in {', '.join(settings.exclude)} left out" if settings.exclude else ""
    return f"{drafts}, {sampling}, up to {settings.max_new_tokens} new tokens per turn{batch}{held_out}"


def number(value: float | None, digits: int, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def table_row(result: SetResult) -> list[str]:
    differing = f"{result.outputs_differing} / {result.num_prompts}"
    if result.outputs_differing is None:
        differing = "n/a (sampled)"
    return [
        result.name,
        str(result.num_prompts),
        number(result.acceptance_length, 3),
        " / ".join(f"{r:.2f}" for r in result.acceptance_per_position) or "n/a",
        number(result.mean_accepted_per_round, 3),
        number(result.spec_tokens_per_s, 1),
        number(result.greedy_tokens_per_s, 1),
        number(result.speedup, 2, "x"),
        differing,
    ]


def markdown(
    sets: list[SetResult], settings: EvalSettings, *, target: str, draft: str, dtype: str, device: torch.device
) -> str:
    lines = [
        "# wingspan eval",
        "",
        f"Target `{target}` ({dtype}), draft `{draft}`: {decoding(settings)}; "
        f"torch {torch.__version__}, on {describe(device)}.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|" + "---:|" * 2 + "---|" + "---:|" * (len(COLUMNS) - 4),
        *("| " + " | ".join(table_row(result)) + " |" for result in sets),
        "",
        "tau: tokens per verification forward, the accepted drafts plus the target's own token (the prefill is "
        "not a verification), over all rounds of the set. Acceptance per position j: of the rounds that proposed "
        "a j-th draft, the share that accepted it. Tokens/s: wall clock of each decoder on the same prompts, "
        "run side by side; speedup = spec / greedy.",
        "",
    ]
    split = [result for result in sets if result.lookup is not None]
    if split:
        sizes = f"{settings.ngram_min}..{settings.ngram_max}"
        lines += [
            f"Where prompt lookup (n-grams of {sizes} tokens, vLLM's `ngram` method) would have proposed drafts, on "
            "the same outputs:",
            "",
            "| " + " | ".join(LOOKUP_COLUMNS) + " |",
            "|---|" + "---:|" * (len(LOOKUP_COLUMNS) - 1),
            *("| " + " | ".join(lookup_row(result)) + " |" for result in split),
            "",
            "Rounds with a match: the context before the round ends in an n-gram that occurs earlier in it. Lookup "
            "tau: what lookup's own drafts (as many as the round had) would have given in those rounds. Lookup "
            "ahead / draft ahead: the share of those rounds where one accepted more tokens than the other. Lookup "
            "decoding tau: greedy lookup decoding of the same outputs, every round (`--ngram` without the clock).",
            "",
        ]
    return "\n".join(lines)


def comparison(
    proposers: dict[str, list[SetResult]], settings: EvalSettings, *, target: str, dtype: str, device: torch.device
) -> str:
    """results.md of a side-by-side eval: per set, one row per proposer, all against the same plain runs."""
    figures = ("tau", "acceptance per position", "spec tok/s", "greedy tok/s", "speedup")  # of results.md's COLUMNS
    columns = ("set", "proposer", *figures)
    rows = []
    for sets in zip(*proposers.values()):
        for label, result in zip(proposers, sets):
            cells = dict(zip(COLUMNS, table_row(result)))
            rows.append([result.name, label, *(cells[column] for column in figures)])
    return "\n".join(
        [
            "# wingspan eval, side by side",
            "",
            f"Target `{target}` ({dtype}): {decoding(settings)}; torch {torch.__version__}, on {describe(device)}. "
            "Each prompt was decoded plainly once and once per proposer, the order rotating from prompt to prompt; "
            "greedy tok/s is that one plain run's. Each proposer's own report is in its directory.",
            "",
            "| " + " | ".join(columns) + " |",
            "|---|---|---:|---|" + "---:|" * 3,
            *("| " + " | ".join(row) + " |" for row in rows),
            "",
        ]
    )


LOOKUP_COLUMNS = (
    "set",
    "rounds with a match",
    "draft tau there",
    "lookup tau there",
    "lookup ahead",
    "draft ahead",
    "draft tau elsewhere",
    "draft acceptance per position, match; elsewhere",
    "lookup decoding tau",
)


def lookup_row(result: SetResult) -> list[str]:
    split = result.lookup

    def rates(values: list[float]) -> str:
        return " / ".join(f"{r:.2f}" for r in values) or "n/a"

    share = split.rounds_with_match / split.rounds if split.rounds else None
    return [
        result.name,
        f"{split.rounds_with_match} / {split.rounds} ({number(share and share * 100, 0, '%')})",
        number(split.tau_with_match, 3),
        number(split.lookup_tau_with_match, 3),
        number(split.lookup_ahead and split.lookup_ahead * 100, 0, "%"),
        number(split.draft_ahead and split.draft_ahead * 100, 0, "%"),
        number(split.tau_without_match, 3),
        f"{rates(split.acceptance_with_match)}; {rates(split.acceptance_without_match)}",
        number(split.lookup_tau, 3),
    ]


def plot_acceptance(sets: list[SetResult], path: Path) -> None:
    """Acceptance rate per draft position, one line per set (tau in the legend)."""
    require_matplotlib()
    from matplotlib.ticker import MaxNLocator

    figure = agg_figure(figsize=(6, 4))
    axes = figure.add_subplot()
    for result in sets:
        rates = result.acceptance_per_position
        if rates:
            tau = number(result.acceptance_length, 2)
            axes.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{result.name} (tau {tau})")
    axes.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1), title="Acceptance per draft position")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend()
    save_png(figure, path)
