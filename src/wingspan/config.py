"""Typed configs that save and load as JSON (or YAML), with errors that name the offending field."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from wingspan.devices import device_name
from wingspan.dtypes import DtypeName
from wingspan.errors import ConfigError
from wingspan.files import write_text_atomically


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, where)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0])
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{where}: expected a mapping of names to values, got {value!r}")
        return {k: _coerce(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if annotation is Any:
        return value
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(annotation, value, where)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < math.inf:
            try:
                return float(value)
            except OverflowError:  # an int beyond any float
                pass
        raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise TypeError(f"unsupported config annotation {annotation!r} at {where}")


def from_dict(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass `cls` from `data`; unknown keys and wrong types are errors naming the field."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    if cls is TrainConfig and "tensorboard" in data and "tensorboard" not in names:
        data = upgraded_train_fields(data)
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where or cls.__name__}: unknown field(s) {unknown}; known: {sorted(names)}")
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in data]
    if missing:
        raise ConfigError(f"{where or cls.__name__}: missing field(s) {missing}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        obj = cls(**kwargs)
    except TypeError as error:
        raise ConfigError(f"{where or cls.__name__}: {error}") from None
    return obj


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def save_json(obj: Any, path: str | Path) -> None:
    write_text_atomically(path, json.dumps(to_dict(obj), indent=2) + "\n")


def read_mapping(path: str | Path) -> dict:
    """Read a JSON or YAML mapping; a parse error names the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read ({error.strerror})") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise ConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {error}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of field names to values")
    return data


def load(cls: type, path: str | Path) -> Any:
    try:
        return from_dict(cls, read_mapping(path))
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


def _parse_value(raw: str) -> Any:
    """YAML scalars and lists, plus the floats YAML 1.1 reads as strings ("3e-4")."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` overrides (value parsed as YAML: numbers, booleans, lists) to a nested mapping."""
    data = json.loads(json.dumps(data))
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.lr=3e-4")
        value = _parse_value(raw)
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[leaf] = value
    return data


def require_range(
    name: str,
    value: float | None,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
) -> None:
    """ConfigError naming the field and its allowed range when `value` (None: unset, allowed) is outside it."""
    if value is None:
        return
    low = f"> {above}" if above is not None else f">= {at_least}" if at_least is not None else ""
    high = f"< {below}" if below is not None else f"<= {at_most}" if at_most is not None else ""
    fine = abs(value) < math.inf and (
        (above is None or value > above)
        and (at_least is None or value >= at_least)
        and (below is None or value < below)
        and (at_most is None or value <= at_most)
    )
    if not fine:
        allowed = " and ".join(part for part in (low, high) if part) or "finite"
        raise ConfigError(f"{name}: must be {allowed}, got {value!r}")


# --------------------------------------------------------------------------------------------------


SCALED_ROPE_TYPES = ("linear", "llama3", "yarn")


@dataclass
class TargetIdentity:
    """The target a draft was trained for, as the draft directory records it: what an export's verifier fields
    and the engine checks need (its vocab and hidden sizes and aux ids are the DraftConfig's own fields)."""

    name_or_path: str  # as the run named it: an embedded name, a checkpoint directory or a hub id
    # the rest is None (or empty) for a draft imported from a layout that does not record it
    model_type: str | None = None  # config.model_type: its family
    architectures: list[str] = field(default_factory=list)  # config.architectures, e.g. ["LlamaForCausalLM"]
    num_hidden_layers: int | None = None
    dtype: DtypeName | None = None  # the dtype its features were computed in


@dataclass
class DraftConfig:
    """The draft architecture. Llama fields follow transformers' LlamaConfig names (and vLLM's export)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_hidden_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    aux_layer_ids: list[int]
    num_hidden_layers: int = 1
    embed_injection: Literal["first", "all"] = "first"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # the target's RoPE scaling, as transformers' rope_parameters without the theta (rope_type llama3, yarn or
    # linear and their fields); None: plain RoPE
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    hidden_act: Literal["silu"] = "silu"
    target: TargetIdentity | None = None  # None: a draft imported without knowing its target
    # chain: each draft token reads the previous one's output; parallel (P-EAGLE): the tokens after the first
    # are drafted in the same forward by mask slots that read `mask_token_id`'s embedding and the learned
    # `mask_hidden` features (docs/formats.md#parallel-drafting)
    draft_mode: Literal["chain", "parallel"] = "chain"
    mask_token_id: int | None = None  # parallel drafts: the target-vocab id mask slots read
    num_parallel_tokens: int | None = None  # parallel drafts: the tokens per round it was trained for (None: unknown)

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "target_hidden_size",
            "vocab_size",
            "num_hidden_layers",
            "max_position_embeddings",
        ):
            require_range(name, getattr(self, name), at_least=1)
        require_range("rms_norm_eps", self.rms_norm_eps, above=0)
        require_range("rope_theta", self.rope_theta, above=0)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ConfigError(f"draft_vocab_size: must be in 1..{self.vocab_size}, got {self.draft_vocab_size}")
        if len(self.aux_layer_ids) < 1 or min(self.aux_layer_ids) < 0:
            raise ConfigError(f"aux_layer_ids: expected target layer numbers >= 0, got {self.aux_layer_ids}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in SCALED_ROPE_TYPES:
            raise ConfigError(
                f"rope_scaling: rope_type {self.rope_scaling.get('rope_type')!r} is not supported for drafts; "
                f"supported: {', '.join(SCALED_ROPE_TYPES)} (a length-dependent RoPE would change with the context)"
            )
        if (self.draft_mode == "parallel") != (self.mask_token_id is not None):
            raise ConfigError("mask_token_id: a parallel draft needs one, and only a parallel draft has one")
        if self.mask_token_id is not None:
            require_range("mask_token_id", self.mask_token_id, at_least=0, below=self.vocab_size)
        if self.num_parallel_tokens is not None:
            if self.draft_mode != "parallel":
                raise ConfigError("num_parallel_tokens: only a parallel draft has one")
            require_range("num_parallel_tokens", self.num_parallel_tokens, at_least=2)

    def draft_tokens(self, asked: int | None) -> int:
        """Draft tokens per round to serve or decode: what was asked, else a parallel draft's trained count, else
        3 (vLLM's usual); a parallel draft asked for more than it was trained for is warned about."""
        k = asked or self.num_parallel_tokens or 3
        if self.num_parallel_tokens is not None and k > self.num_parallel_tokens:
            print(
                f"warning: {k} draft tokens per round, but this parallel draft was trained for "
                f"{self.num_parallel_tokens}: mask slots beyond that were never trained"
            )
        return k


# 3, not EAGLE-3's 7: on the default target the 4th and later positions are accepted under 2% of the time, and
# TTT 3 trained a better draft than TTT 7 on the same data in less time (+0.04 tau, docs/results/recipe.md)
TTT_STEPS_DEFAULT = 3

# What each TTT step minimises (`wingspan.train.ttt.ttt_forward`): forward KL, or the LK loss (-log acceptance).
LossName = Literal["kl", "lk"]


def upgraded_train_fields(data: dict) -> dict:
    """A run config written before `tracker` replaced `tensorboard: bool` (a run's config.json, a recipe file),
    read as it meant."""
    data = dict(data)
    if data.pop("tensorboard"):
        data["tracker"] = list(dict.fromkeys([*data.get("tracker", []), "tensorboard"]))
    return data


@dataclass
class TrainConfig:
    """Everything a training run needs. Saved as `config.json` in the run's output directory."""

    target: str = "smollm2-135m-instruct"
    data: list[str] = field(default_factory=list)  # conversation files (ShareGPT / OpenAI messages / EAGLE)
    # a `wingspan dump` directory: train from its stored target features instead of running the target
    # (data may then be empty; when given, it must be the dump's files)
    from_dump: str | None = None
    output_dir: str = "runs/draft"
    vocab: str | None = None  # a vocab.safetensors from `wingspan vocab`; built from the data when None
    # a Jinja chat template file, for targets that ship none (base models) or to replace the target's own
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # template variables: {enable_thinking: false}
    learn_reasoning: bool = True  # false: reasoning in replies (<think>...</think>) is kept out of the loss
    # true: the whole conversation is in the loss, prompts and template text too, with the target's labels there
    learn_prompts: bool = False
    # target
    device: str = "auto"  # auto (the GPU when there is one), cpu, cuda, cuda:N; under torchrun each rank's GPU
    target_dtype: DtypeName = "bfloat16"
    aux_layer_ids: list[int] | None = None  # default [2, N//2, N-3]
    # draft
    num_hidden_layers: int = 1
    embed_injection: Literal["first", "all"] = "first"
    draft_vocab_size: int = 16384
    init_from_target: bool = True  # fc passes the last aux layer through; norm, lm_head from the target
    # draft layer i starts as the target's layer (last aux id + i), the layer the last aux feature enters (a
    # layer reading the embeddings too gets zeros for them); Llama-shaped target layers only
    init_layers_from_target: bool = False
    # layer 0 starts with a copy (induction) head: what followed an earlier occurrence of the input token, as
    # prompt lookup proposes (wingspan.train.copy_head); needs init_from_target, and a draft as wide as the target.
    # Unset: on for a new chain draft that can hold it, off otherwise (chosen when the run starts, and recorded)
    init_copy_head: bool | None = None
    # a wingspan draft directory (a run's draft, a checkpoint, `wingspan import`'s output) whose weights and
    # vocab the training starts from, with a fresh optimizer; its shape must be the run's
    init_from: str | None = None
    # data
    max_length: int = 1024
    batch_tokens: int = 2048  # token budget of one micro-batch
    # Pack whole conversations back to back into rows of max_length tokens, batch_tokens // max_length rows
    # a micro-batch: no compute spent on padding. Positions restart at each conversation and attention never
    # crosses one, so the loss is what the conversations give one by one. False: one conversation per row,
    # right-padded, bucketed by length.
    pack: bool = True
    shuffle: bool = True
    # TTT
    ttt_steps: int = TTT_STEPS_DEFAULT
    step_decay: float = 0.8
    # parallel (P-EAGLE): after the first draft token, num_parallel_tokens - 1 mask slots draft the rest in the
    # same forward; the unroll then trains those num_parallel_tokens predictions (weights step_decay^j)
    # instead of ttt_steps chain steps. mask_token_id: the id mask slots read (default: the target's last id)
    draft_mode: Literal["chain", "parallel"] = "chain"
    num_parallel_tokens: int = 4
    mask_token_id: int | None = None
    # the loss's weight where the context ends in a bigram seen earlier in the conversation (where prompt lookup
    # would propose: teach the draft to copy); 1 weighs every position alike
    repeat_weight: float = 1.0
    # kl: the soft cross-entropy against the target's distribution; lk: -log of the acceptance rate sampling
    # would have, sum_v min(p_v, q_v) (docs/training.md, "The loss")
    loss: LossName = "kl"
    # HASS's top-K term (Zhang et al. 2024, arXiv 2408.15766), added to `loss` at every step with this weight:
    # the cross-entropy over the target's `topk_loss_k` most likely tokens only, which the draft's ranking decides
    # acceptance by (0: off; docs/training.md, "The loss")
    topk_loss_weight: float = 0.0
    topk_loss_k: int = 10
    # optimisation. lr and epochs unset: chosen for the target's width and the data's size when the run starts,
    # and recorded in the run's config.json (docs/training.md, "Defaults")
    lr: float | None = None
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_ratio: float = 0.03
    grad_clip: float = 0.5
    grad_accum: int = 1
    epochs: float | None = None
    max_steps: int | None = None  # optimizer steps; overrides epochs when set
    # run the draft in bf16 autocast (the target dtype is target_dtype); unset: on GPUs yes, on CPUs no
    autocast_bf16: bool | None = None
    seed: int = 0
    # under torchrun: replicate the draft on every rank (ddp), or shard each decoder layer and the rest of
    # the draft over the ranks (fsdp, FSDP2) when its weights and AdamW state are too large to replicate
    parallel: Literal["ddp", "fsdp"] = "ddp"
    # a non-finite loss or gradient norm: stop the run (its last checkpoint stays as it was), or skip the step
    # (counted and logged; ten in a row stop it). skip reads the gradient norm back every step (a host sync on GPUs)
    on_nonfinite: Literal["stop", "skip"] = "stop"
    # bookkeeping
    save_every: int = 200  # optimizer steps between checkpoints (and always at the end)
    keep_checkpoints: int = 2  # the newest N stay on disk (more: score the draft along its training)
    log_every: int = 10
    tracker: list[Literal["tensorboard", "wandb"]] = field(default_factory=list)  # logged to, besides metrics.jsonl
    num_threads: int | None = None

    def __post_init__(self) -> None:
        try:
            device_name(self.device)
        except ConfigError as error:
            raise ConfigError(f"device: {error}") from None
        for name, bounds in TRAIN_RANGES.items():
            require_range(name, getattr(self, name), **bounds)
        for index, beta in enumerate(self.betas):
            require_range(f"betas[{index}]", beta, at_least=0, below=1)
        if len(self.betas) != 2:
            raise ConfigError(f"betas: expected two numbers, got {self.betas}")
        if self.batch_tokens < self.max_length:
            raise ConfigError(f"batch_tokens ({self.batch_tokens}) must be >= max_length ({self.max_length})")
        if self.aux_layer_ids is not None and (not self.aux_layer_ids or min(self.aux_layer_ids) < 0):
            raise ConfigError(f"aux_layer_ids: expected target layer numbers >= 0, got {self.aux_layer_ids}")
        if self.draft_mode == "chain" and self.mask_token_id is not None:
            raise ConfigError("mask_token_id: for parallel drafts only (draft_mode: parallel)")
        if self.draft_mode == "parallel" and self.ttt_steps != TTT_STEPS_DEFAULT:
            raise ConfigError("ttt_steps: chain drafts only; a parallel draft trains num_parallel_tokens predictions")
        if self.init_copy_head and (self.init_from or self.init_layers_from_target or not self.init_from_target):
            raise ConfigError(
                "init_copy_head: plants a head in a new draft started from the target (init_from_target: true); "
                "not with init_from or init_layers_from_target"
            )
        if self.topk_loss_weight and self.topk_loss_k > self.draft_vocab_size:
            raise ConfigError(
                f"topk_loss_k: {self.topk_loss_k} is more than the draft vocab's {self.draft_vocab_size} tokens"
            )
        if self.init_from and self.vocab:
            raise ConfigError("init_from and vocab: a draft to start from brings its own vocab; set one of them")

    @property
    def unroll_steps(self) -> int:
        """The predictions trained per origin: chain TTT steps, or a parallel draft's tokens per round."""
        return self.num_parallel_tokens if self.draft_mode == "parallel" else self.ttt_steps


# The numeric fields of TrainConfig and their allowed ranges (require_range's keywords).
TRAIN_RANGES: dict[str, dict[str, float]] = {
    "num_hidden_layers": {"at_least": 1},
    "draft_vocab_size": {"at_least": 1},
    "max_length": {"at_least": 2},
    "batch_tokens": {"at_least": 2},
    "ttt_steps": {"at_least": 1},
    "num_parallel_tokens": {"at_least": 2},
    "mask_token_id": {"at_least": 0},
    "step_decay": {"above": 0, "at_most": 1},
    "lr": {"above": 0},
    "min_lr_ratio": {"at_least": 0, "at_most": 1},
    "weight_decay": {"at_least": 0},
    "warmup_ratio": {"at_least": 0, "below": 1},
    "grad_clip": {"above": 0},
    "repeat_weight": {"above": 0},
    "topk_loss_weight": {"at_least": 0},
    "topk_loss_k": {"at_least": 1},
    "grad_accum": {"at_least": 1},
    "epochs": {"above": 0},
    "max_steps": {"at_least": 1},
    "seed": {"at_least": 0, "below": 2**63},
    "save_every": {"at_least": 1},
    "keep_checkpoints": {"at_least": 1},
    "log_every": {"at_least": 1},
    "num_threads": {"at_least": 1},
}
