"""The training loop: target features, TTT unroll, AdamW with warmup + cosine, accumulation, checkpoints.

`train()` is the whole recipe in one function, top to bottom. The target's side of each micro-batch comes
from a feature source (`wingspan.train.features`): the target run on it, or a hidden-state dump. Resuming
restores weights, optimizer, RNG and the data position, and the batch plan is a pure function of (seed,
epoch), so an interrupted run continued with `resume=True` ends with the same weights as an uninterrupted one.

Under torchrun the same function runs on every rank (`wingspan.train.distributed`): each optimizer step's
micro-batches are shared out among the ranks, the gradient is the one-process gradient, and rank 0 alone
writes metrics and checkpoints, which hold the global data position, so any number of processes resumes them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from tqdm import tqdm

from wingspan.config import DraftConfig, TargetIdentity, TrainConfig, save_json, to_dict
from wingspan.data.batching import MicroBatch, collate, plan_epoch
from wingspan.data.template import TokenizedConversation
from wingspan.data.vocab import DraftVocab
from wingspan.devices import release_freed_memory
from wingspan.dtypes import dtype_name
from wingspan.errors import CheckpointError, ConfigError, TrainingError, WingspanError
from wingspan.models.draft import Eagle3Draft, write_draft
from wingspan.models.families import rope_parameters
from wingspan.trackers import WANDB_RUN_ID, Trackers
from wingspan.train.checkpoint import Checkpoint, checkpoint_directories, resume_point, save_checkpoint
from wingspan.train.copy_head import plant_copy_head, with_copy_head_default
from wingspan.train.distributed import (
    World,
    clip_grad_norm_,
    current_world,
    full_optimizer_state,
    full_weights,
    gradient_sync,
    load_optimizer_state,
    parallelize,
    print0,
    share_of_step,
)
from wingspan.train.features import FeatureSource, OnlineFeatures
from wingspan.train.resume import cut_metrics, describe_run, require_same_run
from wingspan.train.ttt import TTTBatch, TTTLoss, simulated_acceptance_length, step_weights_of

# On the CPU, freed tensors' pages go back to the system every this many steps (release_freed_memory): without
# it the process grows step after step; releasing more often bounds it tighter at more cost in throughput
# (bench/train_memory.py).
RELEASE_MEMORY_EVERY = 10

# The learning rate of the measured recipe for SmolLM2-135M (hidden size 576) at 2048-token steps, a flat optimum
# (1e-3 and 4e-3 measured no different: docs/results/recipe.md). It is the default lr for a target that wide,
# scaled by 576 / hidden size for wider ones (Adam's rule under muP for the matrices that read the hidden state),
# and not raised for narrower ones, where it was never measured.
DEFAULT_LR = 2e-3
DEFAULT_LR_WIDTH = 576
# The default epochs: as many passes as it takes to train on this many tokens, within [1, MAX_DEFAULT_EPOCHS].
DEFAULT_TRAINED_TOKENS = 1_000_000
MAX_DEFAULT_EPOCHS = 3.0


def with_defaults(config: TrainConfig, hidden_size: int, data_tokens: int) -> TrainConfig:
    """`config` with an unset lr chosen for the target's width and unset epochs (when max_steps does not set the
    length) for the data's size (tokens of one pass); the choices are printed."""
    chosen: dict[str, float] = {}
    if config.lr is None:
        chosen["lr"] = DEFAULT_LR * min(1.0, DEFAULT_LR_WIDTH / hidden_size)
        print0(f"lr: {chosen['lr']:.2e}, the default for a target {hidden_size} wide")
    if config.epochs is None and config.max_steps is None:
        chosen["epochs"] = round(min(MAX_DEFAULT_EPOCHS, max(1.0, DEFAULT_TRAINED_TOKENS / max(1, data_tokens))), 2)
        print0(f"epochs: {chosen['epochs']:g}, the default for {data_tokens} tokens a pass")
    return dataclasses.replace(config, **chosen)


def learning_rate(step: int, total: int, config: TrainConfig, planned: int | None = None) -> float:
    """Linear warmup over `warmup_ratio` of the `planned` steps (default: `total`), then cosine decay to
    `min_lr_ratio * lr` at `total`: a paced run's moving end moves the cosine, never back into the warmup."""
    warmup = max(1, round(config.warmup_ratio * (planned or total)))
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def draft_config_for(target, config: TrainConfig, vocab_size: int, draft_vocab_size: int) -> DraftConfig:
    """A draft shaped like one decoder layer of the target (vLLM requires draft hidden == target hidden)."""
    hf = target.config
    rope_theta, rope_scaling = rope_parameters(hf)
    return DraftConfig(
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=getattr(hf, "num_key_value_heads", hf.num_attention_heads),
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        target_hidden_size=hf.hidden_size,
        vocab_size=vocab_size,
        draft_vocab_size=draft_vocab_size,
        aux_layer_ids=list(target.aux_layer_ids),
        num_hidden_layers=config.num_hidden_layers,
        embed_injection=config.embed_injection,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=hf.max_position_embeddings,
        draft_mode=config.draft_mode,
        num_parallel_tokens=config.num_parallel_tokens if config.draft_mode == "parallel" else None,
        mask_token_id=mask_token_id_for(config, vocab_size),
        target=TargetIdentity(
            name_or_path=target.name,
            model_type=hf.model_type,
            architectures=list(target.model.config.architectures or []),
            num_hidden_layers=target.num_layers,
            dtype=dtype_name(str(target.dtype).removeprefix("torch.")),
        ),
    )


def mask_token_id_for(config: TrainConfig, vocab_size: int) -> int | None:
    """A parallel run's mask token: the config's; else, continuing a parallel draft (`init_from`), that draft's,
    whose `mask_hidden` was trained with it; else the target's last id."""
    from wingspan.pipeline import starting_draft

    if config.draft_mode == "chain":
        return None
    if config.mask_token_id is not None:
        return config.mask_token_id
    start = starting_draft(config.init_from, names=())[0] if config.init_from else None
    return vocab_size - 1 if start is None or start.mask_token_id is None else start.mask_token_id


def build_draft(target, config: TrainConfig, d2t: torch.Tensor, t2d: torch.Tensor) -> Eagle3Draft:
    draft = Eagle3Draft(draft_config_for(target, config, t2d.numel(), d2t.numel()))
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.embed_weight())
        if config.init_from_target:
            # Start in the target's own feature space: fc passes the last aux layer through, and norm and
            # lm_head are the target's final norm and its readout rows of the draft vocab. The draft then
            # learns to move target-like hidden states one token ahead, not a vocab projection from scratch.
            hidden = target.hidden_size
            draft.fc.weight.zero_()
            draft.fc.weight[:, -hidden:] = torch.eye(hidden)
            draft.lm_head.weight.copy_(target.lm_head_weight()[draft.draft_to_target(torch.arange(d2t.numel()))])
            draft.norm.weight.copy_(target.norm_weight())
        if config.init_layers_from_target:
            copy_target_layers(draft, target)
    return draft


# A Llama decoder layer's weights: what a draft layer computes, and all it can start from.
LLAMA_LAYER = {
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    *(f"self_attn.{name}_proj.weight" for name in "qkvo"),
    *(f"mlp.{name}_proj.weight" for name in ("gate", "up", "down")),
}


def copy_target_layers(draft: Eagle3Draft, target) -> None:
    """Draft layer i <- target layer (last aux id + i): the layers the last aux feature goes through next. In a
    layer that also reads the embeddings, the target's input norm and q/k/v act on the hidden-state half and
    the embedding half of q/k/v starts at zero."""
    first = max(target.aux_layer_ids)
    depth = draft.config.num_hidden_layers
    if first + depth > target.num_layers:
        raise ConfigError(
            f"init_layers_from_target: {depth} draft layers from target layer {first} (the last aux layer) pass "
            f"the target's {target.num_layers} layers; use fewer layers or earlier aux_layer_ids"
        )
    hidden = draft.config.hidden_size
    for index, layer in enumerate(draft.layers):
        source = dict(target.layers[first + index].named_parameters())
        if set(source) != LLAMA_LAYER or target.family.norm_offset:
            raise ConfigError(
                f"init_layers_from_target: the target's decoder layers ({target.config.model_type}) are not Llama "
                f"layers (weights {sorted(set(source) ^ LLAMA_LAYER)}, norm offset {target.family.norm_offset}); "
                "the draft's cannot start as them"
            )
        mine = dict(layer.named_parameters())
        for name, weight in source.items():
            if layer.takes_embeddings and name in (
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
            ):
                mine[name].zero_()
                mine[name][:, hidden:] = weight
            elif layer.takes_embeddings and name == "input_layernorm.weight":
                layer.hidden_norm.weight.copy_(weight)
            else:
                mine[name].copy_(weight)


def start_from(draft: Eagle3Draft, directory: str) -> None:
    """Load an `init_from` draft's weights into the run's new draft, whose shape must be the same. A chain
    draft may start a parallel run: its weights are the parallel draft's but the mask's, which starts fresh."""
    from wingspan.pipeline import starting_draft

    config, weights = starting_draft(directory)
    ours = dataclasses.asdict(draft.config) | {"target": None}
    theirs = dataclasses.asdict(config) | {"target": None}
    if config.draft_mode == "chain" and draft.config.draft_mode == "parallel":
        theirs |= {"draft_mode": "parallel", "mask_token_id": draft.config.mask_token_id}
        weights = weights | {"mask_hidden": draft.mask_hidden.detach().cpu()}
    if config.draft_mode == "parallel" and draft.config.draft_mode == "chain":
        raise ConfigError(f"init_from {directory}: a parallel draft; set draft_mode: parallel to train it further")
    # the tokens per round may change: more training of a parallel draft may serve more (or fewer) of them
    differ = [
        f"{k}: the draft has {theirs[k]}, the run {ours[k]}"
        for k in ours
        if ours[k] != theirs[k] and k != "num_parallel_tokens"
    ]
    if differ:
        raise ConfigError(f"init_from {directory}: not the run's draft shape ({'; '.join(differ)})")
    draft.load_trainable_state({k: v.to(draft.fc.weight.device) for k, v in weights.items()}, source=directory)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl: one record a logging window."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def training_rate(windows: list[dict[str, Any]]) -> float:
    """Non-pad tokens a second over logging windows: all their tokens over all their time, so that a window
    of few tokens weighs as little as it took. Windows of skipped steps only (no tokens) are left out."""
    timed = [w for w in windows if w["tokens"]]
    return sum(w["tokens"] for w in timed) / sum(w["tokens"] / w["tokens_per_s"] for w in timed)


class MetricLog:
    """Per-step sums over a logging window -> loss_j, acc_j, simulated acceptance length, gradient norm.

    Each rank sums its own micro-batches; `flush` adds up the ranks' sums (every rank must call it) and
    rank 0 writes the record, so the figures are those of the whole global batch.
    """

    def __init__(self, run_dir: Path, config: TrainConfig, world: World, device: torch.device) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.steps = config.unroll_steps
        self.world = world
        self.device = device
        self.trackers = Trackers(config.tracker, run_dir, to_dict(config), job="train", enabled=world.is_main)
        self.reset()

    def reset(self) -> None:
        # loss sum, correct and count per TTT step, then the tokens, in one tensor: one all-reduce per flush
        self.sums = torch.zeros(3 * self.steps + 1, dtype=torch.float64, device=self.device)
        self.grad_norm_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # the same on every rank
        self.optimizer_steps = 0
        self.skipped = 0
        self.started = time.perf_counter()

    def add(self, metrics: StepMetrics) -> None:
        if metrics.skipped:
            self.skipped += 1
            return
        self.sums += metrics.sums
        self.grad_norm_sum += metrics.grad_norm
        self.optimizer_steps += 1

    def flush(self, step: int, lr: float) -> dict:
        loss_sum, correct, count, tokens = self.world.sum(self.sums).cpu().split([self.steps] * 3 + [1])
        # A window of skipped steps only measured nothing: its figures are NaN here, null in the file.
        count = count.clamp(min=1) if self.optimizer_steps else torch.full_like(count, float("nan"))
        accuracy = (correct / count).tolist()
        record = {"step": step, "lr": lr}
        record.update({f"loss_{j}": v for j, v in enumerate((loss_sum / count).tolist())})
        record.update({f"acc_{j}": v for j, v in enumerate(accuracy)})
        record["sim_accept_len"] = simulated_acceptance_length(accuracy, len(accuracy))
        record["grad_norm"] = self.grad_norm_sum.item() / self.optimizer_steps if self.optimizer_steps else None
        record["tokens"] = int(tokens.item())  # non-pad tokens trained on in the window
        record["tokens_per_s"] = tokens.item() / max(1e-9, time.perf_counter() - self.started)
        record["skipped_steps"] = self.skipped
        # JSON has no NaN or inf: a non-finite figure (a window of skipped steps only) is written as null
        record = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in record.items()}
        self.reset()
        if not self.world.is_main:
            return record
        with self.path.open("a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        self.trackers.scalars(record, step)
        return record


def to_device(batch: TTTBatch, device: torch.device) -> TTTBatch:
    """The batch on `device`; to a GPU through pinned memory without waiting, so that the copy overlaps the
    work already queued (tensors already there, such as the online target's features, are not copied)."""
    if device.type != "cuda":
        return TTTBatch(*(getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)))
    tensors = (getattr(batch, f.name) for f in dataclasses.fields(batch))
    return TTTBatch(*(t if t.device == device else t.pin_memory().to(device, non_blocking=True) for t in tensors))


def uses_autocast(config: TrainConfig, device: torch.device) -> bool:
    """Whether the draft runs under bf16 autocast: `autocast_bf16` when set, else on GPUs only."""
    return device.type == "cuda" if config.autocast_bf16 is None else config.autocast_bf16


@dataclass
class Trainee:
    """A draft being trained: `model` computes its TTT loss (wrapped for DDP or FSDP under torchrun) and
    `optimizer` updates its trainable parameters, on `device`."""

    draft: Eagle3Draft
    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device


def prepare_draft(
    target,
    config: TrainConfig,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    world: World,
    checkpoint: Checkpoint | None = None,
    copy_samples: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Trainee:
    """A draft for `target` on its device (a new one, or `checkpoint`'s weights and optimizer state), wrapped
    for `world`; the optimizer is built after the wrapping because FSDP2 replaces the parameters. `config`'s lr
    must be set: `with_defaults` chooses an unset one, as `train` does. `copy_samples`: the target's aux
    features and tokens a new draft's copy head is planted from (`init_copy_head`, `copy_head_samples`)."""
    if config.lr is None:
        raise ValueError("prepare_draft: config.lr is unset; pass with_defaults(config, hidden_size, data_tokens)")
    device = target.device
    draft = build_draft(target, config, d2t, t2d)
    if config.init_copy_head and not checkpoint:
        if copy_samples is None:
            raise ValueError("prepare_draft: init_copy_head needs copy_samples (copy_head_samples)")
        generator = torch.Generator().manual_seed(config.seed)
        accuracy, sinks = plant_copy_head(draft, *copy_samples, config.max_length, generator)
        rest = (
            f"it rests on the target's attention sink ({sinks} of the samples)" if sinks else "no attention sink found"
        )
        print0(
            f"init_copy_head: a copy head planted in layer 0 (its probe names the current token {accuracy:.0%}; {rest})"
        )
    draft = draft.to(device)
    if checkpoint:
        draft.load_trainable_state(checkpoint.weights, source=str(checkpoint.path))
    elif config.init_from:
        start_from(draft, config.init_from)
    step_weights = [config.step_decay**j for j in range(config.unroll_steps)]
    model = parallelize(
        TTTLoss(
            draft,
            config.unroll_steps,
            step_weights,
            config.repeat_weight,
            config.loss,
            (config.topk_loss_weight, config.topk_loss_k),
        ),
        draft,
        config.parallel,
        world,
        device,
    )
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, betas=tuple(config.betas), weight_decay=config.weight_decay)
    if checkpoint:
        load_optimizer_state(draft, optimizer, checkpoint.optimizer_state)
    return Trainee(draft, model, optimizer, device)


@dataclass
class StepMetrics:
    """What one optimizer step measured on this rank."""

    loss: torch.Tensor  # the objective of this rank's micro-batches (detached)
    sums: torch.Tensor  # float64 [3 * steps + 1]: loss sum, correct and count per TTT step, then non-pad tokens
    grad_norm: torch.Tensor  # before clipping; the same on every rank
    skipped: bool = False  # on_nonfinite=skip: the gradient was not finite and no update was made


def step_normaliser(group: list[MicroBatch], steps: int, repeat_weight: float) -> torch.Tensor:
    """[steps]: the counted positions of each TTT step over the whole global batch `group` (weighted as the loss
    weighs them), which divides every micro-batch's loss, so that accumulation and data parallelism weight
    every token alike."""
    weights = (step_weights_of(m.loss_mask, m.positions, m.input_ids, steps, repeat_weight) for m in group)
    return sum(w.sum(dim=(1, 2)) for w in weights).clamp(min=1)


def train_step(
    trainee: Trainee, group: list[MicroBatch], features: FeatureSource, lr: float, config: TrainConfig, world: World
) -> StepMetrics:
    """One optimizer step over the global batch `group` (the same micro-batches on every rank): this rank's
    share of them (`share_of_step`) forward and backward, then gradient clipping and AdamW at `lr`."""
    device = trainee.device
    normaliser = step_normaliser(group, config.unroll_steps, config.repeat_weight).to(device)
    for param_group in trainee.optimizer.param_groups:
        param_group["lr"] = lr
    loss = torch.zeros((), device=device)
    sums = torch.zeros(3 * config.unroll_steps + 1, dtype=torch.float64, device=device)
    share = share_of_step(group, world)
    for k, (micro, scale) in enumerate(share):
        batch = to_device(features(micro), device)
        with gradient_sync(trainee.model, last=k == len(share) - 1):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=uses_autocast(config, device)):
                result = trainee.model(batch, normaliser)
            (result.loss * scale).backward()
        if scale:
            tokens = result.count.new_tensor([int(micro.attention_mask.sum())])
            sums += torch.cat([result.loss_sum, result.correct, result.count, tokens])
            loss += result.loss.detach()
    trainable = [p for param_group in trainee.optimizer.param_groups for p in param_group["params"]]
    grad_norm = clip_grad_norm_(trainable, config.grad_clip)
    # The global norm is the same on every rank, so every rank skips the same steps. A non-finite loss on any
    # rank makes it non-finite too.
    skipped = config.on_nonfinite == "skip" and not bool(torch.isfinite(grad_norm))
    if not skipped:
        trainee.optimizer.step()
    trainee.optimizer.zero_grad(set_to_none=True)
    return StepMetrics(loss, sums, grad_norm, skipped)


COPY_HEAD_SAMPLES = 16384  # tokens of the run's first micro-batches that a copy head's probe is fitted on


def copy_head_samples(
    sequences: list[TokenizedConversation],
    lengths: list[int],
    config: TrainConfig,
    features: FeatureSource,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's aux features [N, num_aux * H] and the tokens [N] at the real positions of the first
    micro-batches of the run's first epoch, unshuffled (every rank reads the same), to COPY_HEAD_SAMPLES tokens."""
    aux, tokens, count = [], [], 0
    for rows in plan_epoch(lengths, config, 0, shuffle=False):
        micro = collate(sequences, rows, pad_id)
        real = micro.attention_mask.bool()
        aux.append(features(micro).aux_hidden.detach().float().cpu()[real])
        tokens.append(micro.input_ids[real])
        count += int(real.sum())
        if count >= COPY_HEAD_SAMPLES:
            break
    return torch.cat(aux), torch.cat(tokens)


MAX_SKIPS_IN_A_ROW = 10  # on_nonfinite=skip: this many non-finite steps in a row stop the run


def batch_sources(sequences: list[TokenizedConversation], records: list[int], limit: int = 4) -> str:
    """The records a global batch was made of, by where they were read, for messages."""
    sources = [sequences[i].source or f"record {i}" for i in records]
    more = f" and {len(sources) - limit} more" if len(sources) > limit else ""
    return ", ".join(sources[:limit]) + more


class FiniteGuard:
    """Stops the run at the first step whose loss or gradient norm is not finite (on_nonfinite=stop), reading
    the steps' flags back only when metrics are logged or a checkpoint is written, so that the hot loop has no
    host sync; the weights are then past saving, and the last checkpoint is the one to go back to. Skipped
    steps (on_nonfinite=skip) are counted and said, and too many in a row stop the run as well."""

    def __init__(self, config: TrainConfig, sequences: list[TokenizedConversation]) -> None:
        self.skip = config.on_nonfinite == "skip"
        self.sequences = sequences
        self.pending: list[tuple[int, list[int], torch.Tensor]] = []  # (step, its records, finite flag) not read yet
        self.skipped = 0
        self.in_a_row = 0

    def add(self, step: int, group: list[MicroBatch], metrics: StepMetrics) -> None:
        records = [i for micro in group for row in micro.rows for i in row]
        if not self.skip:
            self.pending.append((step, records, torch.isfinite(metrics.loss) & torch.isfinite(metrics.grad_norm)))
            return
        if not metrics.skipped:
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += 1
        sources = batch_sources(self.sequences, records)
        print0(f"warning: step {step}: non-finite gradient norm, skipped ({self.skipped} so far); batch: {sources}")
        if self.in_a_row >= MAX_SKIPS_IN_A_ROW:
            raise TrainingError(
                f"steps {step - self.in_a_row + 1}-{step}: {self.in_a_row} non-finite steps in a row; the draft "
                "cannot learn from here (lr too high? damaged data?); its last checkpoint is as it was"
            )

    def check(self, last_checkpoint: int) -> None:
        """Raise at the first pending step that was not finite (rank 0 and every other rank alike)."""
        if not self.pending:
            return
        flags = torch.stack([flag for _, _, flag in self.pending]).tolist()
        pending, self.pending = self.pending, []
        for (step, records, _), finite in zip(pending, flags):
            if not finite:
                sources = batch_sources(self.sequences, records)
                kept = f"step {last_checkpoint}'s checkpoint is as it was" if last_checkpoint else "nothing was saved"
                raise TrainingError(
                    f"step {step}: the loss or the gradient norm is not finite (NaN or inf); batch: {sources}; "
                    f"the run stops ({kept}); on_nonfinite=skip skips such steps instead"
                )


def open_run(
    config: TrainConfig,
    record: dict,
    resume: bool | Literal["if-any"],
    built_vocab: DraftVocab | None,
    device: torch.device,
) -> Checkpoint | None:
    """Check the run directory against `resume`, and a resumed run against its checkpoint's record, before
    anything there is written (under torchrun: on every rank, and none writes unless all passed); then write
    the run's config (and `built_vocab`) and cut metrics.jsonl back to the step training goes on from. Returns
    the checkpoint to resume (None: a fresh start)."""
    world = current_world()
    refusal: Exception | None = None
    checkpoint = None
    try:
        checkpoint = check_run_directory(config, record, resume)
    except (WingspanError, OSError) as error:
        refusal = error
    refused = world.sum(torch.tensor([float(refusal is not None)], device=device)).item()
    if refusal is not None:
        raise refusal
    if refused:
        raise CheckpointError(f"{config.output_dir}: another rank refused to start the run (its message says why)")
    if world.is_main:
        run_dir = Path(config.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_json(config, run_dir / "config.json")
        if built_vocab is not None:
            built_vocab.save(run_dir / "vocab.safetensors")
        resumed_at = checkpoint.trainer_state["step"] if checkpoint else 0
        if cut_metrics(run_dir / "metrics.jsonl", resumed_at) and (run_dir / WANDB_RUN_ID).exists():
            # W&B keeps the steps the interrupted run logged after the checkpoint and ignores a step logged twice:
            # the steps run again go to a new W&B run, not silently nowhere
            (run_dir / WANDB_RUN_ID).unlink()
            print0(f"W&B: the interrupted run logged steps after {resumed_at}; this run logs to a new W&B run")
    return checkpoint


def check_run_directory(config: TrainConfig, record: dict, resume: bool | Literal["if-any"]) -> Checkpoint | None:
    run_dir = Path(config.output_dir)
    checkpoint = resume_point(run_dir) if resume else None
    has_checkpoints = bool(checkpoint_directories(run_dir))
    if checkpoint is None and (has_checkpoints or (run_dir / "draft").exists()):
        held = "checkpoints" if has_checkpoints else "a finished draft and no checkpoint"
        raise FileExistsError(
            f"{run_dir} already holds {held}: "
            + (
                "pass --resume to continue it, or choose another output_dir"
                if not resume
                else "choose another output_dir"
            )
        )
    if resume is True and checkpoint is None:
        raise CheckpointError(
            f"{run_dir}: --resume, but there is no checkpoint to continue; start it without --resume "
            "(or with --resume-or-start)"
        )
    if checkpoint:
        for note in require_same_run(checkpoint.path, checkpoint.trainer_state, record):
            print0(f"resume: {note}")
    return checkpoint


def train(
    config: TrainConfig,
    target,
    sequences: list[TokenizedConversation],
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    resume: bool | Literal["if-any"] = False,
    features: FeatureSource | None = None,
    built_vocab: DraftVocab | None = None,
    pace: Callable[[int, int], int | None] | None = None,
) -> Path:
    """Train a draft on `sequences` against `target`; returns the directory of the final draft.

    `features` gives the target's side of each micro-batch (default: the target runs on it); the target
    itself is still needed for the draft's shape, frozen embeddings and initial weights. The draft trains
    on the target's device. `resume`: continue output_dir from its latest checkpoint, which must exist
    (True) or may not ("if-any"); see `open_run`. `built_vocab`: the vocab (d2t, t2d) built for this run, saved
    in output_dir once the resume check has passed. `pace`: fits the run's end to a clock as it trains; called
    on rank 0 at each `save_every` step before the end, before that checkpoint is written, with the step and the
    steps in a pass, it returns the step to end at (None: the same), and every rank ends there. A resumed run is
    not paced: unless its passes or max_steps were changed, it ends where its checkpoint says (the clock of the
    interrupted process is gone). Under torchrun every rank calls this with the same arguments.
    """
    world = current_world()
    config = with_defaults(config, target.hidden_size, sum(len(s.input_ids) for s in sequences))
    config = with_copy_head_default(config, draft_config_for(target, config, t2d.numel(), d2t.numel()))
    features = features or OnlineFeatures(target, d2t)
    run_dir = Path(config.output_dir)
    run_record = describe_run(config, target, sequences, d2t, t2d)
    checkpoint = open_run(config, run_record, resume, built_vocab, target.device)
    world.barrier()  # the run directory is checked and set up before any rank trains
    torch.manual_seed(config.seed)
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    lengths = [len(s.input_ids) for s in sequences]
    copy_samples = None
    if config.init_copy_head and not checkpoint:
        copy_samples = copy_head_samples(sequences, lengths, config, features, pad_id)
    trainee = prepare_draft(target, config, d2t, t2d, world, checkpoint, copy_samples)

    batches_per_epoch = len(plan_epoch(lengths, config, 0, shuffle=False))
    steps_per_epoch = max(1, batches_per_epoch // config.grad_accum)
    planned_steps = total_steps = config.max_steps or max(1, math.ceil(config.epochs * steps_per_epoch))

    step, epoch, batch_index = 0, 0, 0
    if checkpoint:
        # Rank 0's CPU generator at save time, restored on every rank. The loop itself draws no random
        # numbers (the data order is a function of seed and epoch); CUDA generators are not saved.
        torch.set_rng_state(checkpoint.rng_state)
        step, epoch, batch_index = (checkpoint.trainer_state[k] for k in ("step", "epoch", "batch_index"))
        recorded = checkpoint.trainer_state.get("run", {}).get("config", {})
        if "end" in checkpoint.trainer_state and all(
            recorded.get(name) == run_record["config"][name] for name in ("epochs", "max_steps")
        ):
            total_steps = checkpoint.trainer_state["end"]  # where its pace, if any, put it
        pace = None
        print0(f"resumed from {checkpoint.path} (step {step}/{total_steps})")
        if step >= total_steps:
            print0(f"resume: the checkpoint is at step {step}, the run ends at {total_steps}: nothing to train")
    if config.grad_accum % world.size:
        print0(
            f"warning: grad_accum={config.grad_accum} micro-batches per step over {world.size} ranks: some "
            f"ranks run a zero-weight micro-batch every step to keep in step; a multiple of {world.size} wastes none"
        )

    log = MetricLog(run_dir, config, world, trainee.device)
    guard = FiniteGuard(config, sequences)
    last_checkpoint = step
    plan = plan_epoch(lengths, config, epoch, config.shuffle)
    progress = tqdm(
        total=total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True, disable=not world.is_main
    )
    try:
        while step < total_steps:
            group = []  # the global batch: every rank plans the same micro-batches
            while len(group) < config.grad_accum:
                if batch_index >= len(plan):
                    epoch, batch_index = epoch + 1, 0
                    plan = plan_epoch(lengths, config, epoch, config.shuffle)
                group.append(collate(sequences, plan[batch_index], pad_id))
                batch_index += 1
            lr = learning_rate(step, total_steps, config, planned_steps)
            metrics = train_step(trainee, group, features, lr, config, world)
            step += 1
            guard.add(step, group, metrics)
            log.add(metrics)
            if trainee.device.type == "cpu" and step % RELEASE_MEMORY_EVERY == 0:
                release_freed_memory()
            progress.update(1)
            if pace and step % config.save_every == 0 and step < total_steps:
                end = pace(step, steps_per_epoch) if world.is_main else 0
                end = total_steps if end is None else end
                # rank 0's clock decides, so that every rank ends at the same step
                end = int(world.sum(torch.tensor([float(end)], device=trainee.device)).item())
                total_steps = progress.total = max(step, end)
            if step % config.log_every == 0 or step == total_steps:
                guard.check(last_checkpoint)
                record = log.flush(step, lr)
                if record["loss_0"] is not None:
                    progress.set_postfix(
                        loss=f"{record['loss_0']:.3f}",
                        acc0=f"{record['acc_0']:.3f}",
                        tau=f"{record['sim_accept_len']:.2f}",
                    )
            if step % config.save_every == 0 or step == total_steps:
                guard.check(last_checkpoint)
                # Every rank gathers (FSDP), rank 0 writes; the data position is global, so any world size resumes it.
                draft = trainee.draft
                weights, optimizer_state = full_weights(draft), full_optimizer_state(draft, trainee.optimizer)
                if world.is_main:
                    position = {
                        "step": step,
                        "epoch": epoch,
                        "batch_index": batch_index,
                        "end": total_steps,
                        "run": run_record,
                    }
                    save_checkpoint(
                        run_dir, step, weights, draft.config, optimizer_state, position, keep=config.keep_checkpoints
                    )
                last_checkpoint = step
                world.barrier()
    finally:  # the trackers' files are complete whether the run ends or stops
        log.trackers.close()
    progress.close()
    final = run_dir / "draft"
    weights = full_weights(trainee.draft)
    if world.is_main:
        write_draft(final, weights, trainee.draft.config)
    world.barrier()  # the final draft is on disk when train returns, on every rank
    return final
