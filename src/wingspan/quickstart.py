"""The main job: from nothing but the embedded target (or prompt files) to a trained, exported 1-layer draft,
measured against plain decoding on the first MT-bench prompts.

Each stage skips work it finds done (synthesis resumes, training resumes from its last checkpoint), so
re-running after an interruption continues where it stopped; the closing measurement runs again each time.
The recipe is explained in docs/quickstart.md.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from wingspan.config import TrainConfig, save_json
from wingspan.errors import ConfigError, DataError

if TYPE_CHECKING:
    from wingspan.budget import Plan, Prompts
    from wingspan.data.conversations import Conversation
    from wingspan.eval.runner import SetResult
    from wingspan.models.target import TargetModel

QUICKSTART_RECIPE = dict(
    target="smollm2-135m-instruct",
    target_dtype="bfloat16",
    # The embeddings (aux id 0) in place of layer 2's features: the planted copy head's key then names each
    # position's token exactly (docs/results/recipe.md, "The embeddings as an aux layer").
    aux_layer_ids=[0, 15, 27],
    # One decoder layer: it replays as well as two at this budget and at the 2-hour recipe's, and vLLM serves it
    # faster (docs/results/layer-study.md, docs/results/proposers.md).
    num_hidden_layers=1,
    draft_vocab_size=8192,
    init_copy_head=True,
    max_length=1024,
    batch_tokens=2048,
    # The recipe's figures (docs/quickstart.md) were measured with padded micro-batches; on its short
    # conversations packing saves little padding, and it would change the measured trajectory.
    pack=False,
    ttt_steps=3,
    lr=2e-3,
    warmup_ratio=0.03,
    min_lr_ratio=0.05,
    epochs=3.0,
    autocast_bf16=True,
    save_every=50,
    log_every=10,
)
SYNTH = dict(num_conversations=360, batch_size=32, max_new_tokens=256)
# The closing measurement: wingspan's own decoder, greedy, at each chain length side by side with one plain baseline.
CHECK = dict(prompt_set="mt_bench", limit=10, max_new_tokens=256, chain_lengths=(1, 3))


def run_quickstart(
    out: Path,
    device: str = "auto",
    conversations: int | None = None,
    prompts: tuple[str, ...] = (),
    prompt_share: float | None = None,
    epochs: float = QUICKSTART_RECIPE["epochs"],
    text: tuple[str, ...] = (),
    text_conversations: int | None = None,
    exclude: tuple[str, ...] = (),
    budget: str | None = None,
) -> Path:
    """The main job (the module's docstring). `conversations`: how many the target writes; with `prompts`
    (prompt or conversation files) it answers their first user turns in `prompt_share` of them and invents the
    rest (`plan_conversations`). `text`: conversation files written by others, of which `text_conversations`
    (default all) are drawn and trained on as they are, at the target's labels, with no generation
    (`text_sample`). `exclude`: prompt sets or files held out of both draws (`held_out_keys`). `epochs`: passes
    over all of them. The defaults are the quickstart's recipe (`conversations` None: SYNTH's count); larger ones
    make the longer recipes of docs/quickstart.md. `budget` (a duration such as 2h) chooses `conversations` and
    `text_conversations` instead, measured on this machine (wingspan/budget.py); `conversations` 0 still means
    text only."""
    from wingspan.budget import Pace, against_plan, saved_plan
    from wingspan.data.conversations import read_finished
    from wingspan.data.synth import regenerate, synthesize
    from wingspan.data.vocab import DraftVocab
    from wingspan.export import export_draft, provenance_of
    from wingspan.models.draft import Eagle3Draft
    from wingspan.models.registry import resolve_target
    from wingspan.pipeline import run_dump, run_training
    from wingspan.train.trainer import read_metrics

    started = time.perf_counter()
    laps = [("", started)]  # (stage, when it ended), named as a budget plan's stages

    def lap(stage: str) -> None:
        laps.append((stage, time.perf_counter()))

    config = TrainConfig(output_dir=str(out / "run"), device=device, **QUICKSTART_RECIPE | {"epochs": epochs})
    held_out = held_out_keys(exclude, prompts + text)
    target = plan = None
    if budget is None:
        conversations = SYNTH["num_conversations"] if conversations is None else conversations
    else:
        budget_s, request = budget_request(
            budget, config, conversations, text_conversations, prompts, prompt_share, text, exclude
        )
        plan = saved_plan(out, budget_s, request)  # an earlier run's, or a refusal, before anything loads
        # The probe needs the target; what it measures decides the draws below.
        target = load_target_once(config)
        if plan is None:
            out.mkdir(parents=True, exist_ok=True)
            plan = measured_plan(budget_s, request, out, config, target, started, held_out)
        print(plan.summary())
        conversations, text_conversations = plan.conversations, plan.text_conversations or None
    sample, invented = plan_conversations(prompts, prompt_share, conversations, config.seed, held_out)
    written = text_sample(text, text_conversations, config.seed, held_out)
    if not (sample or invented or written):
        raise ConfigError("--conversations 0: needs --text (nothing else to train on)")
    replies_path, synth_path, text_path = out / "replies.jsonl", out / "synth.jsonl", out / "text.jsonl"
    data = (
        ([str(replies_path)] if sample else [])
        + ([str(synth_path)] if invented else [])
        + ([str(text_path)] if written else [])
    )
    # The target's features are dumped once and read back every epoch: its forward is half of an online step.
    dump_dir = out / "dump"
    config = dataclasses.replace(config, data=data, from_dump=str(dump_dir))
    out.mkdir(parents=True, exist_ok=True)
    if written:  # first: a rerun that drew other text is refused before anything is replaced
        keep_text(written, text_path)
    if invented and synth_path.exists():  # synthesize() extends a file, and keeps one that holds more
        earlier = len(read_finished(synth_path))
        if earlier > invented:
            raise ConfigError(
                f"{synth_path}: holds {earlier} conversations of an earlier run, more than the {invented} asked for "
                "now; give a changed setting its own --out"
            )
    save_json(config, out / "train_config.json")

    target = target or load_target_once(config)
    lap("so far")

    if sample:
        print(f"[2/5] the target's replies to {len(sample)} prompts from {', '.join(prompts)} -> {replies_path}")
        report = regenerate(
            target,
            sample,
            replies_path,
            max_new_tokens=SYNTH["max_new_tokens"],
            batch_size=SYNTH["batch_size"],
            max_length=config.max_length,
            seed=config.seed,
            resume=True,
        )
        print(report.summary())
    if invented:
        print(f"[2/5] synthesizing {invented} conversations with the target -> {synth_path}")
        synthesize(
            target,
            invented,
            synth_path,
            batch_size=SYNTH["batch_size"],
            max_new_tokens=SYNTH["max_new_tokens"],
            seed=config.seed,
            resume=True,
        )
    if written:
        print(f"[2/5] {len(written)} conversations written by others, from {', '.join(text)}: {text_path}")

    lap("the target's conversations")

    print(f"[3/5] the target's features -> {dump_dir}, then the draft vocab and training")
    manifest = run_dump(config, dump_dir, resume=True, target=target)
    lap("features")
    pace = None
    if plan is not None:
        # A rerun trains the passes fitted before, unpaced: the clock of the process that fitted them is gone.
        if plan.training_passes is None:
            pace = Pace(deadline=started + plan.seconds_left(0.0), max_passes=plan.request["epochs"])
        config = fit_training_to_budget(plan, config, out, time.perf_counter() - started, manifest.num_tokens)
    draft_dir = run_training(config, resume="if-any", target=target, pace=pace)
    lap("training")
    if pace and pace.summary():
        print(f"[3/5] {pace.summary()}")

    print("[4/5] export for vLLM")
    export_dir = out / "vllm-draft"
    draft = Eagle3Draft.load(draft_dir, embed_weight=target.embed_weight())
    export_draft(draft, export_dir, "vllm", provenance=provenance_of(draft_dir))

    print(f"[5/5] measuring the export against plain decoding on {CHECK['limit']} {CHECK['prompt_set']} first turns")
    measured = measure_draft(target, export_dir, out / "eval", config.target_dtype, **CHECK)
    lap("closing measurement")

    vocab_path = Path(config.output_dir) / "vocab.safetensors"
    vocab = DraftVocab.load(vocab_path)
    metrics = read_metrics(Path(config.output_dir))
    last = metrics[-1]
    accuracies = "  ".join(f"acc_{j}={last[f'acc_{j}']:.3f}" for j in range(config.ttt_steps))
    minutes = (time.perf_counter() - started) / 60
    planned = by_stage = ""
    if plan is not None:
        spent = {stage: end - laps[i][1] for i, (stage, end) in enumerate(laps[1:])}
        planned = f" (predicted {plan.predicted_total_s / 60:.1f} for --budget {budget})"
        by_stage = f"\n  by stage      : {against_plan(plan, spent)}"
    serving = json.dumps({"method": "eagle3", "model": str(export_dir), "num_speculative_tokens": fastest(measured)})
    print(f"""
done in {minutes:.1f} min{planned}{by_stage}
  conversations : {", ".join(data)}
  target features: {dump_dir} (read by `wingspan train -c {out / "train_config.json"}` too)
  draft vocab   : {vocab_path} ({vocab.draft_vocab_size} tokens, {vocab.coverage:.1%} coverage)
  training run  : {config.output_dir} (metrics.jsonl, checkpoints/)
  draft         : {draft_dir}
  vLLM export   : {export_dir}
  last per-step accuracies (TTT, teacher tokens): {accuracies}
  simulated acceptance length: {last["sim_accept_len"]:.2f}
{measurement_lines(measured, export_dir, out / "eval", config.target_dtype, CHECK)}
serve it:  vllm serve {resolve_target(config.target)} --speculative-config '{serving}'""")
    return export_dir


def load_target_once(config: TrainConfig) -> TargetModel:
    from wingspan.pipeline import load_target

    print(f"[1/5] target {config.target} ({config.target_dtype})")
    return load_target(config)


def budget_request(
    budget: str,
    config: TrainConfig,
    conversations: int | None,
    text_conversations: int | None,
    prompts: tuple[str, ...],
    prompt_share: float | None,
    text: tuple[str, ...],
    exclude: tuple[str, ...],
) -> tuple[float, dict]:
    """--budget in seconds and the options a plan for it depends on; the sizes it chooses given too are refused."""
    from wingspan.budget import parse_budget

    if conversations not in (None, 0) or text_conversations is not None:
        raise ConfigError(
            "--budget: chooses --conversations and --text-conversations; give those or --budget "
            "(--conversations 0 alone is kept: text only)"
        )
    if conversations == 0 and not text:
        raise ConfigError("--conversations 0: needs --text (nothing else to train on)")
    request = dict(
        epochs=config.epochs,
        generate=conversations is None,
        prompts=list(prompts),
        prompt_share=prompt_share,
        text=list(text),
        exclude=list(exclude),
    )
    return parse_budget(budget), request


def measured_plan(
    budget_s: float,
    request: dict,
    out: Path,
    config: TrainConfig,
    target: TargetModel,
    started: float,
    held_out: frozenset[str],
) -> Plan:
    """How many conversations the target writes and how many of --text are drawn so that the whole job fits
    `budget_s` on this machine, from the probe's rates (wingspan/budget.py); written to out/budget.json."""
    from wingspan.budget import measure_rates, plan_sizes, save_plan

    pool = text_sample(tuple(request["text"]), None, config.seed, held_out)
    lengths = list(training_tokens(target, config, pool))
    prompts = prompt_sample(tuple(request["prompts"]), None, config.seed, held_out) if request["prompts"] else []
    share = (1.0 if request["prompt_share"] is None else request["prompt_share"]) if prompts else 0.0
    asked = answered_prompts(target.tokenizer, prompts, share, config)
    print(f"[0/5] measuring this machine for the budget: one batch of each stage, in {out / 'probe'} (removed after)")
    rates = measure_rates(target, config, out / "probe", SYNTH, prompts, asked, pool, lengths)
    closing_tokens = CHECK["limit"] * CHECK["max_new_tokens"] * (1 + len(CHECK["chain_lengths"]))
    so_far = time.perf_counter() - started
    room = dump_room(target, out)
    plan = plan_sizes(budget_s, request, rates, lengths, closing_tokens, so_far, max_tokens=room, prompts=asked)
    save_plan(plan, out)
    return plan


def answered_prompts(tokenizer, prompts: list[Conversation], share: float, config: TrainConfig) -> Prompts:
    """`prompts` as the quickstart's regeneration answers them in `share` of its conversations: their chat-prompt
    lengths, SYNTH's batches, and the longest prompt that leaves room for a whole reply within max_length."""
    from wingspan.budget import Prompts
    from wingspan.data.template import chat_prompt

    return Prompts(
        lengths=[len(chat_prompt(tokenizer, c.as_dicts())) for c in prompts],
        share=share,
        batch_size=SYNTH["batch_size"],
        longest=config.max_length - SYNTH["max_new_tokens"],
    )


def training_tokens(target: TargetModel, config: TrainConfig, conversations: list[Conversation]) -> Iterator[int]:
    """The tokens of each conversation as training reads it; one by one, so that one the template cannot take
    counts 0."""
    from wingspan.data.template import tokenize_conversations

    for conversation in conversations:
        tokenized, _ = tokenize_conversations(
            target.tokenizer, [conversation], config.max_length, config.learn_reasoning, config.learn_prompts
        )
        yield len(tokenized[0].input_ids) if tokenized else 0


def dump_room(target: TargetModel, out: Path) -> float:
    """The tokens whose features fit on the disk under `out`: the dump is the run's only large file, and stops
    where 90% of the free space would fill."""
    from wingspan.data.hidden_states import bytes_per_token

    return 0.9 * shutil.disk_usage(out).free / bytes_per_token(target.hidden_size, len(target.aux_layer_ids))


def fit_training_to_budget(plan: Plan, config: TrainConfig, out: Path, spent_s: float, tokens: int) -> TrainConfig:
    """`config` with the passes training starts with: those that still fit the budget once `spent_s` have gone
    (`fitted_passes`), chosen when training first starts and kept in the plan, so that a rerun resumes the same
    training; said when they are fewer than the plan's. Its end then follows the clock (`Pace`)."""
    from wingspan.budget import fitted_passes, save_plan

    passes = plan.training_passes
    if passes is None:
        passes = fitted_passes(plan, spent_s, tokens)
        save_plan(dataclasses.replace(plan, training_passes=passes), out)
        late = spent_s - plan.predicted_through("features")
        why = f"the stages before it took {late / 60:.1f} min more than predicted"
    else:
        why = "as fitted to the budget when training first started"
    if passes < config.epochs:
        print(f"[3/5] training starts with {passes:g} passes in place of {config.epochs:g}: {why}")
    config = dataclasses.replace(config, epochs=passes)
    save_json(config, out / "train_config.json")
    return config


def held_out_keys(exclude: tuple[str, ...], drawn_from: tuple[str, ...]) -> frozenset[str]:
    """The user turns of the prompt sets or files in `exclude` (specs as for `wingspan eval --sets`, named sets
    included), compared as `wingspan eval --exclude` compares them: a conversation whose first user turn is among
    them is never drawn, so these sets stay held out of training."""
    from wingspan.eval.prompts import user_turn_keys

    if exclude and not drawn_from:
        raise ConfigError("--exclude: needs --prompts or --text (the files it holds prompts out of)")
    return frozenset(user_turn_keys(list(exclude)))


def plan_conversations(
    prompts: tuple[str, ...],
    prompt_share: float | None,
    conversations: int,
    seed: int,
    held_out: frozenset[str] = frozenset(),
) -> tuple[list[Conversation], int]:
    """The prompts the target answers and how many conversations it invents, `conversations` in all: with prompt
    files, `prompt_share` (default all) of them answer first user turns drawn from the files (`prompt_sample`),
    and where the files hold fewer prompts than that, invented ones make up the count."""
    if prompt_share is None:
        prompt_share = 1.0
    elif not prompts:
        raise ConfigError("--prompt-share: needs --prompts (the share of conversations that answer them)")
    if not 0 <= prompt_share <= 1:
        raise ConfigError(f"--prompt-share: expected a share from 0 to 1, got {prompt_share}")
    answered = round(prompt_share * conversations) if prompts else 0
    sample = prompt_sample(prompts, answered, seed, held_out) if answered else []
    if len(sample) < answered:
        print(
            f"--prompts: {len(sample)} prompts in {', '.join(prompts)}, fewer than {answered}: "
            "the target invents the rest"
        )
    return sample, conversations - len(sample)


def prompt_sample(
    files: tuple[str, ...], count: int | None, seed: int, held_out: frozenset[str] = frozenset()
) -> list[Conversation]:
    """`count` (None: all) conversations drawn at random (seeded) from all of `files` together, each cut to its
    first user turn (and any system message before it): the prompts the target answers. Fewer when the files
    hold fewer."""
    pool = []
    for conversation in _drawn(files, "--prompts", seed, held_out, require_assistant=False)[:count]:
        first_user = next(i for i, m in enumerate(conversation.messages) if m.role == "user")
        pool.append(dataclasses.replace(conversation, messages=conversation.messages[: first_user + 1]))
    return pool


def text_sample(
    files: tuple[str, ...], count: int | None, seed: int, held_out: frozenset[str] = frozenset()
) -> list[Conversation]:
    """`count` (default all) conversations with assistant turns drawn at random (seeded) from all of `files`
    together, kept whole: text written by others, which the draft learns at the target's labels."""
    if not files:
        if count is not None:
            raise ConfigError("--text-conversations: needs --text (the files to draw them from)")
        return []
    if count is not None and count < 1:
        raise ConfigError(f"--text-conversations: expected at least 1, got {count}")
    return _drawn(files, "--text", seed, held_out, require_assistant=True)[:count]


def keep_text(written: list[Conversation], path: Path) -> None:
    """Write the drawn text to `path`, a file of its own so that the training config alone says what was trained
    on; a rerun finds it there, and one that drew other text is refused (ConfigError) and `path` left as it is."""
    from wingspan.data.conversations import read_conversations, write_conversations_jsonl

    if path.exists():
        kept, _ = read_conversations(path)
        if [(c.id, c.as_dicts()) for c in kept] != [(c.id, c.as_dicts()) for c in written]:
            raise ConfigError(
                f"{path}: holds another draw of --text (other files or --text-conversations); "
                "give a changed setting its own --out"
            )
        return
    write_conversations_jsonl(written, path)


def _drawn(
    files: tuple[str, ...], option: str, seed: int, held_out: frozenset[str], require_assistant: bool
) -> list[Conversation]:
    """All conversations of `files` in a seeded random order, less those whose first user turn is `held_out`
    (the rest keep the order they have without it); with several files, ids name their file too (regeneration
    resumes by id, and two files may share one)."""
    from wingspan.data.conversations import read_conversations
    from wingspan.eval.prompts import turn_key

    pool = []
    for path in files:
        # each with a user turn (and an assistant turn when required), or a DataError naming the file
        conversations, report = read_conversations(path, require_assistant=require_assistant)
        if report.skipped:
            print(report.summary())
        for conversation in conversations:
            named = f"{Path(path).name}/{conversation.id}" if len(files) > 1 else conversation.id
            pool.append(dataclasses.replace(conversation, id=named))
    repeated = [i for i, n in Counter(c.id for c in pool).items() if n > 1]
    if repeated:
        raise DataError(f"{option}: ids {repeated[:3]} occur more than once in {', '.join(files)}")
    random.Random(f"{option.strip('-')}/{seed}").shuffle(pool)
    if held_out:
        kept = [c for c in pool if turn_key(next(m.content for m in c.messages if m.role == "user")) not in held_out]
        print(f"{option}: {len(pool) - len(kept)} of {len(pool)} conversations left out (in --exclude)")
        pool = kept
    return pool


def measure_draft(
    target: TargetModel,
    draft_dir: Path,
    out: Path,
    dtype: str,
    *,
    prompt_set: str,
    limit: int,
    max_new_tokens: int,
    chain_lengths: tuple[int, ...],
) -> dict[int, SetResult]:
    """`wingspan eval --first-turns` of the draft at each chain length against one plain baseline, in-process on
    the loaded target (in `dtype`); each report goes to out/k<K>. Returns the set's result per chain length."""
    from wingspan.eval.prompts import load_prompt_sets
    from wingspan.eval.report import write_report
    from wingspan.eval.runner import EvalSettings, evaluate_side_by_side, load_draft

    prompts = load_prompt_sets([prompt_set], limit)[prompt_set]
    draft = load_draft(draft_dir, target)
    shapes = [
        EvalSettings(num_draft_tokens=k, max_new_tokens=max_new_tokens, limit=limit, first_turns=True)
        for k in chain_lengths
    ]
    names = [f"{prompt_set}, chain of {k}" for k in chain_lengths]
    measured = dict(zip(chain_lengths, evaluate_side_by_side(target, [(draft, s) for s in shapes], prompts, names)))
    for k, settings in zip(chain_lengths, shapes):
        write_report(
            out / f"k{k}",
            [measured[k]],
            settings,
            target=target.name,
            draft=str(draft_dir),
            dtype=dtype,
            device=target.device,
        )
    return measured


def fastest(measured: dict[int, SetResult]) -> int:
    return max(measured, key=lambda k: measured[k].speedup or 0.0)


def measurement_lines(measured: dict[int, SetResult], draft_dir: Path, out: Path, dtype: str, check: dict) -> str:
    """What the closing measurement printed: one line per chain length, the best one, and how to measure more."""
    lines = [
        f"measured on the first turns of {check['limit']} {check['prompt_set']} prompts (wingspan's decoder, greedy, "
        f"up to {check['max_new_tokens']} new tokens, side by side with plain decoding; reports in {out}):"
    ]
    for k, result in measured.items():
        acceptance = " / ".join(f"{r:.2f}" for r in result.acceptance_per_position) or "n/a"
        tau = "n/a" if result.acceptance_length is None else f"{result.acceptance_length:.2f}"
        speedup = "n/a" if result.speedup is None else f"{result.speedup:.2f}x"
        lines.append(
            f"  {k} draft token(s) per round: tau {tau}, acceptance per position {acceptance}, speedup {speedup}"
        )
    best = fastest(measured)
    lines.append(
        f"  fastest in wingspan's engine here: {best} per round. Measure more (80 prompts a set, three sets): wingspan "
        f"eval --draft {draft_dir} --dtype {dtype} --num-draft-tokens {best} --first-turns --out {out / 'full'}"
    )
    return "\n".join(lines)
