"""The layer-scaling study: one draft per (depth D, embedding injection, drafting mode) under the same data,
token budget, schedule and seed, each evaluated with its decoders (a chain draft with the chain and the tree
decoder, a parallel one with its own); then a log-linear fit and a report.

Layout of the output directory (every stage skips what it finds done, so re-running continues):

    study.json                     the StudyConfig (a re-run must match it, except the grid and the sets)
    shared/vocab.safetensors       one draft vocab for every setting
    shared/dump/                   one hidden-state dump (`wingspan dump`) every setting trains from
    settings/<name>/run/           the training run (checkpoints, metrics.jsonl, draft/ when finished)
    settings/<name>/eval/<decoder>/<set>.json   one SetResult per decoder and prompt set (a ReplayedSet when the
                                                study replays references)
    results.json, report.md, tau_vs_depth.png, speedup_vs_depth.png   (wingspan.study.report; no speedup plot
                                                                       when replayed)

With D = 1 both injection modes are the same model (layer 0 always reads the embeddings), so the grid
trains it once, as setting "D1" (a parallel draft: "P-D1"), and both series start from it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from wingspan.config import TTT_STEPS_DEFAULT, TrainConfig, from_dict, read_mapping, save_json, to_dict
from wingspan.errors import ConfigError
from wingspan.eval.prompts import EvalPrompt, load_prompt_sets
from wingspan.eval.replay import References, layer_columns, replay
from wingspan.eval.runner import evaluate, load_draft
from wingspan.files import write_text_atomically
from wingspan.models.draft import Eagle3Draft
from wingspan.study.config import EXTENSIBLE_FIELDS, Setting, SettingResult, StudyConfig
from wingspan.study.report import write_study_report
from wingspan.trackers import TrackerName, Trackers
from wingspan.train.trainer import read_metrics


def open_study(config: StudyConfig, out: Path) -> StudyConfig:
    """Save `config` in a new study directory, or check it against the one already there."""
    path = out / "study.json"
    if path.exists():
        saved = read_mapping(path)
        current = to_dict(config)
        for name, value in current.items():
            if name not in EXTENSIBLE_FIELDS and saved.get(name) != value:
                raise ConfigError(
                    f"{path}: this study was started with {name}={saved.get(name)!r}, now "
                    f"{value!r}; use another output directory for a different study"
                )
    save_json(config, path)
    return config


# ------------------------------------------------------------------------------------------------ stages


def prepare_shared(config: StudyConfig, out: Path, target):
    """The draft vocab and the hidden-state dump every setting trains from (each made once, resumably)."""
    from wingspan.data.hidden_states import dump_identity, write_dump
    from wingspan.data.vocab import DraftVocab
    from wingspan.pipeline import build_vocab, tokenized_dataset

    base = config.base_train_config()
    records = tokenized_dataset(base.data, target.tokenizer, base.max_length, base.learn_reasoning, base.learn_prompts)
    vocab_path = out / "shared" / "vocab.safetensors"
    if vocab_path.exists():
        vocab = DraftVocab.load(vocab_path)
        print(f"draft vocab: {vocab_path} ({vocab.draft_vocab_size} tokens, {vocab.coverage:.1%} coverage)")
    else:
        build_vocab(target, records, base.draft_vocab_size, vocab_path)
    dump_dir = out / "shared" / "dump"
    manifest = write_dump(
        target, records, dump_identity(base, target), dump_dir, batch_tokens=base.batch_tokens, resume=True
    )
    return vocab_path, dump_dir, manifest.num_tokens


def setting_train_config(
    config: StudyConfig, setting: Setting, out: Path, vocab_path: Path, dump_dir: Path, dump_tokens: int
) -> TrainConfig:
    """The shared training config with this setting's depth, injection and mode (a parallel draft trained for
    the chain's drafts per round); the budget becomes epochs of the dump, so every setting sees the same tokens
    in the same order."""
    fields = {
        **to_dict(config.base_train_config()),
        "from_dump": str(dump_dir),
        "vocab": str(vocab_path),
        "output_dir": str(setting_dir(out, setting) / "run"),
        "num_hidden_layers": setting.layers,
        "embed_injection": setting.injection,
        "epochs": config.budget_tokens / dump_tokens,
    }
    if setting.mode == "parallel":
        # ttt_steps is the chain's unroll: a parallel draft trains its num_parallel_tokens predictions instead
        fields |= {
            "draft_mode": "parallel",
            "num_parallel_tokens": config.num_draft_tokens,
            "ttt_steps": TTT_STEPS_DEFAULT,
        }
    return from_dict(TrainConfig, fields, where=setting.name)


def setting_dir(out: Path, setting: Setting) -> Path:
    return out / "settings" / setting.name


def result_path(out: Path, setting: Setting, decoder: str, prompt_set: str) -> Path:
    """Where one decoder's result on one prompt set is kept (a SetResult, or a ReplayedSet when replayed)."""
    return setting_dir(out, setting) / "eval" / decoder / f"{prompt_set}.json"


def train_setting(config: TrainConfig, target) -> Path:
    """Train (or resume, or skip when finished) one setting; returns its final draft directory."""
    from wingspan.pipeline import run_training

    final = Path(config.output_dir) / "draft"
    if (final / "draft_config.json").exists():
        return final
    return run_training(config, resume="if-any", target=target)


def evaluate_setting(
    config: StudyConfig, setting: Setting, draft_dir: Path, target, prompt_sets: dict[str, list[EvalPrompt]], out: Path
) -> None:
    """Each of the setting's decoders on every prompt set; a (decoder, set) with a result on disk is not
    measured again."""
    draft = None
    for decoder in measured_decoders(config, setting):
        settings = config.eval_settings(decoder)
        for name, prompts in prompt_sets.items():
            path = result_path(out, setting, decoder, name)
            if path.exists():
                continue
            if draft is None:
                draft = load_draft(draft_dir, target)
            print(f"[{setting.name}] {decoder} on {name}")
            result = evaluate(target, draft, prompts, settings, name=f"{setting.name} {decoder} {name}")
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(
                path, json.dumps({"settings": to_dict(settings), "result": to_dict(result)}, indent=1) + "\n"
            )


def replay_setting(
    config: StudyConfig, setting: Setting, draft_dir: Path, target, references: References, out: Path
) -> None:
    """The setting's draft scored on the references' replies (`wingspan replay score`), one result per set, in
    place of `evaluate_setting`; a decoder whose results are all on disk is not scored again."""
    for decoder in measured_decoders(config, setting):
        paths = {name: result_path(out, setting, decoder, name) for name in references.set_names()}
        if all(path.exists() for path in paths.values()):
            continue
        print(f"[{setting.name}] {decoder}, replayed on {config.references}")
        settings = {"references": config.references, "num_draft_tokens": config.num_draft_tokens}
        for result in replay(load_draft(draft_dir, target), references, config.num_draft_tokens):
            paths[result.name].parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(
                paths[result.name], json.dumps({"settings": settings, "result": to_dict(result)}, indent=1) + "\n"
            )


def measured_decoders(config: StudyConfig, setting: Setting) -> list[str]:
    return [decoder for decoder in setting.decoders if decoder in config.decoders()]


def open_references(config: StudyConfig, target) -> References:
    """The study's references, checked against its target before any training: the same target, and the aux
    layers the drafts read."""
    references = References.load(config.references)
    if references.target != config.target:
        raise ConfigError(
            f"{config.references}: references of target {references.target!r}; the study trains for "
            f"{config.target!r} (make them with `wingspan replay references --target {config.target}`)"
        )
    layer_columns(list(target.aux_layer_ids), references, "the study's drafts")
    return references


# ------------------------------------------------------------------------------------------------ results


def collect(config: StudyConfig, out: Path, prompt_sets: list[str]) -> list[SettingResult]:
    rows = []
    for setting in config.settings():
        directory = setting_dir(out, setting)
        final = directory / "run" / "draft"
        if not (final / "draft_config.json").exists():
            continue
        draft = Eagle3Draft.load(final)
        parameters = sum(p.numel() for name, p in draft.named_parameters() if not name.startswith("embed_tokens"))
        metrics = read_metrics(directory / "run")
        evals: dict[str, dict[str, dict[str, Any]]] = {}
        cost: dict[str, float | None] = {}
        prompts: dict[str, dict[str, list[tuple[str, int, int]]]] = {}
        for decoder in measured_decoders(config, setting):
            results = {}
            for name in prompt_sets:
                path = result_path(out, setting, decoder, name)
                if path.exists():
                    results[name] = json.loads(path.read_text())["result"]
            evals[decoder] = {name: {k: v for k, v in r.items() if k != "prompts"} for name, r in results.items()}
            cost[decoder] = draft_cost(list(results.values()))
            prompts[decoder] = {
                name: [(p["id"], len(p["accepted_per_round"]), sum(p["accepted_per_round"])) for p in r["prompts"]]
                for name, r in results.items()
            }
        rows.append(
            SettingResult(
                setting.name,
                setting.layers,
                setting.injection,
                parameters,
                sum(m["tokens_per_s"] for m in metrics) / len(metrics),
                metrics[-1],
                evals,
                cost,
                prompts,
                setting.mode,
            )
        )
    return rows


def draft_cost(results: list[dict[str, Any]]) -> float | None:
    """Seconds per drafted token over seconds per token of plain decoding: what one draft step costs in
    target forwards, as the decoders ran them (prefill included on the plain side, a small share); None for
    replayed results, which have no times."""
    prompts = [p for r in results for p in r["prompts"]]
    if any("spec_draft_s" not in p for p in prompts):
        return None
    drafted = sum(sum(p["drafted_per_round"]) for p in prompts)
    greedy_tokens = sum(p["greedy_new_tokens"] for p in prompts)
    greedy_s = sum(p["greedy_s"] for p in prompts)
    if not drafted or not greedy_tokens or not greedy_s:
        return None
    return (sum(p["spec_draft_s"] for p in prompts) / drafted) / (greedy_s / greedy_tokens)


def run_study(
    config: StudyConfig,
    out: Path,
    threads: int | None = None,
    device: str | None = None,
    trackers: list[TrackerName] | None = None,
) -> Path:
    """Every stage in order; returns the report's path. Re-running continues where it stopped, on any `device`
    (not part of the study: it changes where the work runs, not what it computes). The study's table goes to
    `trackers` at the end (each setting's training logs to its own `tracker` setting)."""
    from wingspan.devices import resolve_device, use_cpu_threads
    from wingspan.pipeline import load_target

    base = config.base_train_config()
    if device is not None:
        base = dataclasses.replace(base, device=device)
    # a bad set or references file fails now, not after hours of training, and before study.json is written
    prompt_sets = {} if config.references else load_prompt_sets(config.sets, config.limit)
    use_cpu_threads(resolve_device(base.device), threads)
    target = load_target(base)
    references = open_references(config, target) if config.references else None
    out.mkdir(parents=True, exist_ok=True)
    open_study(config, out)
    set_names = references.set_names() if references else list(prompt_sets)
    # drafts are scored with the target's embeddings in the references' dtype, as `wingspan replay score` does
    scorer = target
    if references and references.dtype != base.target_dtype:
        scorer = load_target(dataclasses.replace(base, target_dtype=references.dtype))
    vocab_path, dump_dir, dump_tokens = prepare_shared(config, out, target)
    print(
        f"budget: {config.budget_tokens:,} tokens per setting = {config.budget_tokens / dump_tokens:.2f} epochs of "
        f"{dump_tokens:,} dumped tokens"
    )
    grid = config.settings()
    for index, setting in enumerate(grid, start=1):
        print(
            f"[{index}/{len(grid)}] {setting.name}: {setting.layers} layer(s), embeddings into {setting.injection}, "
            f"{setting.mode} drafting"
        )
        draft_dir = train_setting(setting_train_config(config, setting, out, vocab_path, dump_dir, dump_tokens), target)
        if references:
            replay_setting(config, setting, draft_dir, scorer, references, out)
        else:
            evaluate_setting(config, setting, draft_dir, target, prompt_sets, out)
        write_study_report(config, out, collect(config, out, set_names))
    if trackers:
        log = Trackers(trackers, out, to_dict(config), "study")
        log.table("study", *study_table(collect(config, out, set_names)))
        log.close()
    return out / "report.md"


def study_table(rows: list[SettingResult]) -> tuple[list[str], list[list]]:
    """(columns, rows) of the study for a tracker: each setting's shape and its tau per decoder and set."""
    measured = list(dict.fromkeys((d, name) for r in rows for d, sets in r.eval.items() for name in sets))
    columns = ["setting", "layers", "injection", "mode", "parameters"] + [f"{d}/{name}/tau" for d, name in measured]
    table = [
        [r.name, r.layers, r.injection, r.mode, r.parameters]
        + [r.eval.get(d, {}).get(name, {}).get("acceptance_length") for d, name in measured]
        for r in rows
    ]
    return columns, table
