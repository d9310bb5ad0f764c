"""The model card every export carries (`README.md`, the hub's format: YAML front matter, then markdown): what
the draft is, what it was trained on and how, what it measured, and how to serve it.

What it knows comes from the draft's config (architecture, target), the run directory the draft came from
when there is one (`<run>/draft` or `<run>/checkpoints/step-N`: the run's config and metrics), and a
`wingspan eval` results.json when one is given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from wingspan.config import DraftConfig
from wingspan.errors import ExportError
from wingspan.train.trainer import read_metrics

CARD = "README.md"
TAGS = ["speculative-decoding", "eagle3", "draft-model", "wingspan"]
# The training settings a reader needs to reproduce the recipe, in this order.
RECIPE_FIELDS = (
    "target_dtype",
    "max_length",
    "batch_tokens",
    "pack",
    "learn_prompts",
    "ttt_steps",
    "draft_mode",
    "num_parallel_tokens",
    "step_decay",
    "repeat_weight",
    "loss",
    "topk_loss_weight",
    "topk_loss_k",
    "lr",
    "min_lr_ratio",
    "warmup_ratio",
    "weight_decay",
    "grad_clip",
    "grad_accum",
    "epochs",
    "max_steps",
    "seed",
)


@dataclass
class Provenance:
    """What an export can say about where its draft came from: the training run and an evaluation."""

    run_config: dict[str, Any] | None = None  # the run's resolved TrainConfig (config.json)
    metrics: list[dict[str, Any]] | None = None  # the run's metrics.jsonl records
    evaluation: dict[str, Any] | None = None  # a `wingspan eval` results.json


def provenance_of(draft_dir: str | Path, evaluation: str | Path | None = None) -> Provenance:
    """The training run a draft directory belongs to (when it is a run's `draft/` or one of its checkpoints),
    and the evaluation results file given, read strictly: a results file that is not one is an error."""
    draft_dir = Path(draft_dir).resolve()
    run = draft_dir.parent if draft_dir.name == "draft" else None
    last_step = None  # a checkpoint's: the run's records after it are not this draft's
    if draft_dir.parent.name == "checkpoints" and draft_dir.name.removeprefix("step-").isdigit():
        run, last_step = draft_dir.parent.parent, int(draft_dir.name.removeprefix("step-"))
    provenance = Provenance()
    if run is not None and (run / "config.json").is_file():
        try:
            provenance.run_config = json.loads((run / "config.json").read_text())
            if (run / "metrics.jsonl").is_file():
                records = read_metrics(run)
                provenance.metrics = [r for r in records if last_step is None or r.get("step", 0) <= last_step]
        except (OSError, ValueError):
            provenance = Provenance()  # an unreadable run says nothing; the card then says less
    if evaluation is not None:
        path = Path(evaluation)
        try:
            provenance.evaluation = json.loads(path.read_text())
        except OSError as error:
            raise ExportError(f"--eval {path}: cannot read ({error.strerror})") from None
        except ValueError as error:
            raise ExportError(f"--eval {path}: not valid JSON ({error})") from None
        if not isinstance(provenance.evaluation, dict) or not isinstance(provenance.evaluation.get("sets"), list):
            raise ExportError(f"--eval {path}: not a `wingspan eval` results.json (no 'sets')")
    return provenance


def target_facts(config: DraftConfig) -> tuple[str | None, str | None]:
    """(base_model, license) of the draft's target: an embedded target's hub origin and license, a hub id as
    it is, a local checkpoint's own card's license."""
    from wingspan.models.registry import EMBEDDED, HUB_ID, checkpoint_dir

    if config.target is None:
        return None, None
    name = config.target.name_or_path
    for short, entry in EMBEDDED.items():
        if name in (short, str(checkpoint_dir(short))):
            return entry.origin, entry.license
    license_name = front_matter(Path(name) / CARD).get("license") if Path(name).is_dir() else None
    return (name if HUB_ID.match(name) else None), license_name


def front_matter(path: Path) -> dict[str, Any]:
    """The YAML front matter of a model card, {} when there is none or it does not parse."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return {}
    if not text.startswith("---"):
        return {}
    try:
        data = yaml.safe_load(text.split("---", 2)[1])
    except (yaml.YAMLError, IndexError):
        return {}
    return data if isinstance(data, dict) else {}


def model_card(config: DraftConfig, engines: str, serve: str, provenance: Provenance) -> str:
    base_model, license_name = target_facts(config)
    meta: dict[str, Any] = {}
    if base_model:
        meta["base_model"] = base_model
    meta |= {"library_name": "wingspan", "pipeline_tag": "text-generation", "tags": TAGS}
    if license_name:
        meta["license"] = license_name
    target = config.target.name_or_path if config.target else "unknown (imported without its target)"
    mode = (
        f"parallel (P-EAGLE): one forward drafts a round, mask token id {config.mask_token_id}"
        if config.draft_mode == "parallel"
        else "chain (one forward per draft token)"
    )
    lines = [
        "---",
        yaml.safe_dump(meta, sort_keys=False).strip(),
        "---",
        "",
        f"# EAGLE-3 draft for {base_model or target}",
        "",
        f"A speculative-decoding draft model trained with [wingspan](https://pypi.org/project/wingspan/) for the "
        f"target `{target}`. Loads in: {engines}.",
        "",
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
        f"| decoder layers | {config.num_hidden_layers} (token embeddings enter layer 0) |",
        f"| hidden size | {config.hidden_size} (target {config.target_hidden_size}) |",
        f"| attention heads | {config.num_attention_heads} ({config.num_key_value_heads} key/value) |",
        f"| draft vocab | {config.draft_vocab_size} of the target's {config.vocab_size} tokens |",
        f"| target features | inputs of target layers {config.aux_layer_ids} |",
        f"| drafting | {mode} |",
        "",
    ]
    lines += training_section(provenance)
    lines += evaluation_section(provenance.evaluation)
    lines += ["## Serve", "", "```bash", serve, "```", ""]
    return "\n".join(lines)


def training_section(provenance: Provenance) -> list[str]:
    run = provenance.run_config
    if run is None:
        return ["## Training", "", "Not recorded with this export (it was not made from a training run).", ""]
    lines = ["## Training", ""]
    if run.get("from_dump"):
        lines.append(f"- features: the hidden-state dump `{run['from_dump']}`")
    data = run.get("data") or []
    if data:
        lines.append("- data: " + ", ".join(f"`{source}`" for source in data))
    metrics = provenance.metrics or []
    if metrics:
        last = metrics[-1]
        tokens = [m.get("tokens") for m in metrics]
        trained = f", {sum(tokens):,} tokens" if tokens and all(isinstance(t, int) for t in tokens) else ""
        lines.append(f"- optimizer steps: {last.get('step')}{trained}")
        accuracies = [last[k] for k in sorted(k for k in last if k.startswith("acc_")) if last[k] is not None]
        if accuracies:
            shown = ", ".join(f"{a:.3f}" for a in accuracies)
            lines.append(f"- last logged training accuracy per draft position (teacher-forced): {shown}")
    recipe = {k: run[k] for k in RECIPE_FIELDS if k in run}
    if run.get("draft_mode") != "parallel":
        recipe.pop("num_parallel_tokens", None)
    else:
        recipe.pop("ttt_steps", None)
    if not recipe.get("topk_loss_weight"):
        recipe.pop("topk_loss_k", None)
    if not recipe.get("learn_prompts"):
        recipe.pop("learn_prompts", None)
    lines += ["- recipe: " + ", ".join(f"`{k}={v}`" for k, v in recipe.items()), ""]
    return lines


def evaluation_section(evaluation: dict[str, Any] | None) -> list[str]:
    if evaluation is None:
        return []
    settings = evaluation.get("settings") or {}
    device = (evaluation.get("environment") or {}).get("device", "?")
    temperature = settings.get("temperature") or 0
    sampling = f"temperature {temperature}" if temperature else "greedy"
    lines = [
        "## Measured",
        "",
        f"`wingspan eval`, {evaluation.get('dtype', '?')} on {device}, {settings.get('num_draft_tokens', '?')} draft "
        f"tokens per round, up to {settings.get('max_new_tokens', '?')} new tokens, {sampling}:",
        "",
        "| set | prompts | acceptance length | per-position acceptance | speedup |",
        "|---|---|---|---|---|",
    ]
    for result in evaluation["sets"]:
        tau, speedup = result.get("acceptance_length"), result.get("speedup")
        positions = " / ".join(f"{r:.2f}" for r in result.get("acceptance_per_position") or [])
        lines.append(
            f"| {result.get('name')} | {result.get('num_prompts')} | "
            f"{'n/a' if tau is None else f'{tau:.2f}'} | {positions or 'n/a'} | "
            f"{'n/a' if speedup is None else f'{speedup:.2f}x'} |"
        )
    return lines + [""]
