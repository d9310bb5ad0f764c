"""What every export format shares: the checks all engines need, the Llama fields of a draft's config, strict
reading of tensors, the logits check, and writing an export atomically (written to a temporary directory,
read back strictly, compared with the draft, then renamed into place). One `Format` per engine layout lives
in its own module (`vllm`, `speculators`, `sglang`); `wingspan.export` lists them.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from wingspan.config import DraftConfig, TargetIdentity, from_dict, to_dict
from wingspan.dtypes import DtypeName, torch_dtype
from wingspan.errors import ConfigError, ExportError
from wingspan.export.card import CARD, Provenance, model_card, target_facts
from wingspan.files import atomic_directory
from wingspan.models.draft import WEIGHTS, Eagle3Draft, new_kv_caches
from wingspan.models.families import FAMILIES

CONFIG = "config.json"
# Relative L2 error of the logits allowed between the draft and its export cast to 16 bits. bf16 keeps 8
# significant bits (relative rounding <= 2^-9 per weight); a few layers compound that to ~1e-2 at most.
HALF_PRECISION_TOLERANCE = 0.03
# Variants of the EAGLE-3 layer (vLLM's, speculators', SGLang's flags) that our draft does not compute.
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "use_aux_norm")


@dataclass(frozen=True)
class ExportSettings:
    dtype: DtypeName = "bfloat16"
    # the target as the serving engine will find it (speculators' verifier name_or_path); None: the draft's
    verifier: str | None = None
    # draft tokens per step a speculators config proposes and serve commands use; None: a parallel draft's trained
    # count, else 3 (vLLM's default)
    speculative_tokens: int | None = None
    # the hub repository the export will be published as: the model card's serve command then names it and the
    # target's hub id (where known) instead of this machine's paths
    repo_id: str | None = None

    def __post_init__(self) -> None:
        from wingspan.models.registry import HUB_ID

        if self.repo_id is not None and not HUB_ID.match(self.repo_id):
            raise ExportError(f"repo_id: expected a hub repository id ORG/NAME, got {self.repo_id!r}")


@dataclass(frozen=True)
class Format:
    """One engine layout. `write` fills a directory with config.json and model.safetensors; `read_config` and
    `read_tensors` turn them back into our DraftConfig and our tensor names (the core checks the result
    strictly); `recognises` tells this layout from the others by its config.json and tensor names."""

    name: str
    engines: str  # who loads it, for messages and --help
    check: Callable[[Eagle3Draft], None]
    write: Callable[[Eagle3Draft, Path, ExportSettings], None]
    recognises: Callable[[dict, set[str]], bool]
    read_config: Callable[[dict, str], DraftConfig]
    read_tensors: Callable[[dict[str, torch.Tensor], DraftConfig, str], dict[str, torch.Tensor]]
    serve: Callable[[DraftConfig, Path, ExportSettings], str]  # the engine's command serving the export at a path


def served_target(config: DraftConfig, settings: ExportSettings) -> str | None:
    """The target as a serving engine opens it: --target, else the draft's own (an embedded target's cached
    checkpoint, not our registry name); None when neither is known."""
    from wingspan.models.registry import EMBEDDED, checkpoint_dir

    name = settings.verifier or (config.target.name_or_path if config.target else None)
    return str(checkpoint_dir(name)) if name in EMBEDDED else name


# ------------------------------------------------------------------------------------------ checks


def check_served(draft: Eagle3Draft, engine: str, engine_name: str) -> None:
    """What no EAGLE-3 engine computes as our draft does: refused for every format."""
    config = draft.config
    model_type = config.target.model_type if config.target else None
    family = FAMILIES.get(model_type or "")
    if family is not None and engine not in family.engines:
        raise ExportError(
            f"the draft's target is a {family.name} model ({model_type}), and {engine_name} serves no EAGLE-3 draft "
            f"for {family.name} targets (its model class does not hand aux hidden states to a draft); "
            "evaluate it with `wingspan eval` instead"
        )
    if config.embed_injection != "first":
        raise ExportError(
            f"embed_injection={config.embed_injection!r}: {engine_name}'s EAGLE-3 draft concatenates the token "
            "embeddings only in layer 0 (q/k/v of layers >= 1 read H, not 2H); only embed_injection='first' "
            "drafts can be exported"
        )
    if config.hidden_size != config.target_hidden_size:
        raise ExportError(
            f"hidden_size={config.hidden_size} differs from target_hidden_size={config.target_hidden_size}: "
            f"{engine_name} feeds the draft the target's own embeddings, which are target_hidden_size wide"
        )
    if config.draft_vocab_size == config.vocab_size and bool(draft.d2t.any()):
        raise ExportError(
            "d2t: the draft vocab is as large as the target's, so the engine builds no draft-to-target mapping and "
            "would read draft id i as target id i, but this draft's d2t is not all zeros"
        )


def refuse_parallel(draft: Eagle3Draft, fmt: str) -> None:
    if draft.config.draft_mode == "parallel":
        raise ExportError(
            f"a parallel draft (mask_token_id, mask_hidden) has no {fmt} layout here; export it with --format vllm "
            'and serve it with "parallel_drafting": true'
        )


def refuse_variants(data: dict, where: str) -> None:
    for flag in UNSUPPORTED_FLAGS:
        if data.get(flag) or (data.get("eagle_config") or {}).get(flag):
            raise ExportError(f"{where}: {flag} is set; wingspan's draft does not implement that variant")


# ------------------------------------------------------------------------------------------ config fields


def llama_fields(config: DraftConfig) -> dict[str, Any]:
    """The draft's decoder layers as transformers' LlamaConfig spells them (vocab_size: the target's)."""
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        # Both spellings: transformers 5 reads rope_parameters, earlier versions (and older engines) rope_theta.
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_theta": config.rope_theta, **(config.rope_scaling or {"rope_type": "default"})},
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
    }


LLAMA_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "rms_norm_eps",
    "vocab_size",
)


def draft_config_from_llama(layer: dict, extra: dict, where: str) -> DraftConfig:
    """Our DraftConfig from a LlamaConfig-like mapping of the draft's layers plus the EAGLE-3 fields in `extra`
    (draft_vocab_size, target_hidden_size, aux_layer_ids, target). What we do not compute is refused."""
    if layer.get("model_type", "llama") != "llama":
        raise ExportError(
            f"{where}: the draft's layers are {layer['model_type']!r} layers; wingspan's draft has Llama layers "
            "(a Qwen3 layer adds q/k norms)"
        )
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise ExportError(f"{where}: attention_bias/mlp_bias is set; wingspan's draft has no bias terms")
    if layer.get("tie_word_embeddings"):
        raise ExportError(f"{where}: tie_word_embeddings is set; a draft's lm_head is its own")
    missing = [name for name in LLAMA_FIELDS if name not in layer]
    if missing:
        raise ExportError(f"{where}: missing field(s) {missing}")
    rope = dict(layer.get("rope_parameters") or layer.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", layer.get("rope_theta", 10000.0))  # transformers' default
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    values = {name: layer[name] for name in LLAMA_FIELDS} | {
        "head_dim": layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        "hidden_act": layer.get("hidden_act", "silu"),
        "max_position_embeddings": layer.get("max_position_embeddings", 8192),
        "rope_theta": theta,
        "rope_scaling": None if rope_type == "default" else rope,
        "embed_injection": "first",
    }
    values |= extra
    values.setdefault("target_hidden_size", values["hidden_size"])
    values.setdefault("draft_vocab_size", values["vocab_size"])
    try:
        return from_dict(DraftConfig, values)
    except ConfigError as error:
        raise ExportError(f"{where}: {error}") from None


def identity_fields(config: DraftConfig) -> dict:
    """The target's identity for a config.json, where the engines ignore it and our reader finds it."""
    return {} if config.target is None else {"wingspan_target": to_dict(config.target)}


def identity_from(data: dict, where: str) -> TargetIdentity | None:
    if "wingspan_target" not in data:
        return None
    try:
        return from_dict(TargetIdentity, data["wingspan_target"], "wingspan_target")
    except ConfigError as error:
        raise ExportError(f"{where}: {error}") from None


# ------------------------------------------------------------------------------------------ tensors


def our_tensors(draft: Eagle3Draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The draft's trainable tensors (the engines take the embeddings from the target), floating ones cast;
    d2t is left out for a full vocab, where the engines build no mapping to load it into."""
    tensors = {}
    for name, tensor in draft.trainable_state_dict().items():
        if name == "d2t" and draft.config.draft_vocab_size == draft.config.vocab_size:
            continue
        tensor = tensor.detach().cpu()
        tensors[name] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
    return tensors


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as error:
        raise ExportError(f"{path}: cannot read the weights ({error})") from None


def strict_draft(config: DraftConfig, state: dict[str, torch.Tensor], embed_weight: torch.Tensor, where: str):
    """An fp32 Eagle3Draft from tensors under our names; every missing, unexpected or misshapen tensor is an
    error naming it. `embed_weight` is the target's input embedding matrix (no export carries it)."""
    draft = Eagle3Draft(config)
    expected = draft.trainable_state_dict()
    if config.draft_vocab_size == config.vocab_size and "d2t" not in state:
        del expected["d2t"]  # a full vocab needs no mapping: the model's zeros are the identity
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ExportError(f"{where}: missing tensor(s) {missing}, unexpected tensor(s) {unexpected}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ExportError(
                f"{where}: {name} has shape {list(tensor.shape)}, the config needs {list(expected[name].shape)}"
            )
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=False)
    if tuple(embed_weight.shape) != (config.vocab_size, config.hidden_size):
        raise ExportError(
            f"embed_weight has shape {list(embed_weight.shape)}, the draft needs "
            f"[{config.vocab_size}, {config.hidden_size}] (the target's input embeddings)"
        )
    draft.embed_tokens.weight.data.copy_(embed_weight)
    return draft


# ------------------------------------------------------------------------------------------ reading


def read_config_json(directory: Path) -> dict:
    path = directory / CONFIG
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise ExportError(f"{path}: cannot read ({error.strerror})") from None
    except ValueError as error:
        raise ExportError(f"{path}: not valid JSON ({error})") from None


def tensor_names(directory: Path) -> set[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(directory / WEIGHTS), "pt") as f:
            return set(f.keys())
    except (OSError, SafetensorError):
        return set()


def read_with(fmt: Format, directory: Path, embed_weight: torch.Tensor) -> Eagle3Draft:
    config_path = directory / CONFIG
    config = fmt.read_config(read_config_json(directory), str(config_path))
    where = str(directory / WEIGHTS)
    state = fmt.read_tensors(read_weights(directory / WEIGHTS), config, where)
    return strict_draft(config, state, embed_weight, where)


@torch.no_grad()
def draft_logits(draft: Eagle3Draft, seed: int = 0, length: int = 8, steps: int = 3) -> torch.Tensor:
    """Logits of a prefill over random target features and tokens, then `steps - 1` chained draft steps (a
    parallel draft: its `steps - 1` mask slots)."""
    config = draft.config
    generator = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, length, len(config.aux_layer_ids) * config.target_hidden_size, generator=generator)
    ids = torch.randint(0, config.vocab_size, (1, length + steps), generator=generator)
    caches = new_kv_caches(draft)
    hidden = draft(draft.project_aux(aux), ids[:, :length], torch.arange(length)[None], caches)
    out = [draft.logits(hidden)]
    if config.draft_mode == "parallel":  # the mask slots of a round from the last position
        slot_hidden, slot_ids = draft.mask_slots(1, steps - 1)
        positions = torch.arange(length, length + steps - 1)[None]
        return torch.cat(out + [draft.logits(draft(slot_hidden, slot_ids, positions, caches))], dim=1)
    hidden = hidden[:, -1:]
    for j in range(1, steps):
        position = torch.tensor([[length - 1 + j]])
        hidden = draft(hidden, ids[:, length + j - 1 : length + j], position, caches)
        out.append(draft.logits(hidden))
    return torch.cat(out, dim=1)


def verify(fmt: Format, draft: Eagle3Draft, directory: Path, dtype: torch.dtype) -> None:
    """The export must compute exactly what `draft` computes with its weights cast to the export dtype
    (fp32 arithmetic on both sides), and stay within 16-bit rounding of the draft itself."""
    reference = copy.deepcopy(draft).float().eval()
    exported = read_with(fmt, directory, reference.embed_tokens.weight).eval()
    rounded = copy.deepcopy(reference)
    cast = {k: v.to(dtype) for k, v in reference.trainable_state_dict().items() if v.is_floating_point()}
    rounded.load_state_dict(cast, strict=False)
    got, exact, original = draft_logits(exported), draft_logits(rounded), draft_logits(reference)
    try:
        torch.testing.assert_close(got, exact)
    except AssertionError as error:
        raise ExportError(f"{directory}: the export does not reproduce the draft's logits:\n{error}") from None
    error = ((got - original).norm() / original.norm()).item()
    if error > HALF_PRECISION_TOLERANCE:
        raise ExportError(
            f"{directory}: casting to {dtype} changes the draft's logits by {error:.3g} (relative L2), "
            f"more than {HALF_PRECISION_TOLERANCE}; export with dtype='float32'"
        )


def write_export(
    fmt: Format,
    draft: Eagle3Draft,
    out_dir: Path,
    settings: ExportSettings,
    replaceable: bool,
    provenance: Provenance | None = None,
) -> Path:
    """Check, write (with its model card), verify, then move into place. An existing `out_dir` is replaced only
    when `replaceable` (it holds an earlier export, or nothing)."""
    fmt.check(draft)
    if not all(bool(torch.isfinite(p.detach()).all()) for p in draft.parameters()):  # no fp32 copy of them all
        raise ExportError("the draft has non-finite weights (NaN or inf); refusing to export it")
    if out_dir.exists() and any(out_dir.iterdir()) and not replaceable:
        raise ExportError(f"{out_dir}: exists and is not a draft export; refusing to replace it")
    with atomic_directory(out_dir) as tmp:
        fmt.write(draft, tmp, settings)
        verify(fmt, draft, tmp, torch_dtype(settings.dtype))
        (tmp / CARD).write_text(
            model_card(
                draft.config, fmt.engines, card_serve(fmt, draft.config, out_dir, settings), provenance or Provenance()
            )
        )
    return out_dir


def card_serve(fmt: Format, config: DraftConfig, out_dir: Path, settings: ExportSettings) -> str:
    """The model card's serve command: this machine's paths, or with a `repo_id` the published names (the
    repository, and the target's hub id where it is known)."""
    if settings.repo_id is None:
        return fmt.serve(config, out_dir.resolve(), settings)
    base_model = target_facts(config)[0]
    return fmt.serve(config, Path(settings.repo_id), replace(settings, verifier=settings.verifier or base_model))


def save_export(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
    (directory / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
