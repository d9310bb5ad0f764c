"""Export a draft in vLLM's EAGLE-3 layout (`LlamaForCausalLMEagle3`, any depth) and read it back.

What vLLM 0.32's `llama_eagle3.py` does with the files, and why the export looks the way it does:
- Its weight loader is not strict: `Eagle3LlamaForCausalLM.load_weights` returns None, so vLLM's check
  that every parameter was loaded never runs and a missing tensor silently stays uninitialised. An
  unexpected name is an error there. Hence `verify_export` reads every export back strictly.
- It builds `hidden_norm` in every layer but reads it only in layer 0; later layers keep vLLM's own
  initial value, so nothing is written for them (our later layers have no hidden_norm).
- It skips every tensor whose name contains `t2d`; `d2t` is loaded only when draft_vocab_size differs
  from the target's vocab size. With equal sizes it builds no mapping and rejects a `d2t` tensor.
- `embed_tokens` is optional: without it vLLM shares the target's embedding (when the widths agree),
  which is what the draft was trained with, so it is not exported.
- RoPE comes from the draft's own config (`rope_parameters` in transformers 5, `rope_theta` before),
  scaled RoPE (llama3, yarn, linear) included.
- The target must implement vLLM's SupportsEagle3 (hand aux hidden states to the draft); Gemma3 does not.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from wingspan.config import DraftConfig, from_dict
from wingspan.dtypes import DtypeName, dtype_name, torch_dtype
from wingspan.errors import ConfigError, ExportError
from wingspan.files import atomic_directory
from wingspan.models.draft import WEIGHTS, Eagle3Draft, new_kv_caches
from wingspan.models.families import FAMILIES

ARCHITECTURE = "LlamaForCausalLMEagle3"
# Variants of vLLM's EAGLE-3 layer that our draft does not compute; an export that sets one is not ours.
UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# Relative L2 error of the logits allowed between the draft and its export cast to 16 bits. bf16 keeps 8
# significant bits (relative rounding <= 2^-9 per weight); a few layers compound that to ~1e-2 at most.
HALF_PRECISION_TOLERANCE = 0.03


def check_exportable(draft: Eagle3Draft) -> None:
    """Refuse what vLLM would load without error but compute differently from our draft."""
    config = draft.config
    family = FAMILIES.get(config.target_model_type or "")
    if family is not None and not family.vllm_eagle3:
        raise ExportError(
            f"the draft's target is a {family.name} model ({config.target_model_type}), and vLLM 0.32 serves no "
            f"EAGLE-3 draft for {family.name} targets (its model class does not implement SupportsEagle3); "
            "evaluate it with `wingspan eval` instead"
        )
    if config.embed_injection != "first":
        raise ExportError(
            f"embed_injection={config.embed_injection!r}: vLLM's {ARCHITECTURE} concatenates the token "
            "embeddings only in layer 0 (q/k/v of layers >= 1 read H, not 2H); only embed_injection='first' "
            "drafts can be exported for vLLM"
        )
    if config.hidden_size != config.target_hidden_size:
        raise ExportError(
            f"hidden_size={config.hidden_size} differs from target_hidden_size={config.target_hidden_size}: "
            "vLLM feeds the draft the target's own embeddings, which are target_hidden_size wide"
        )
    if config.draft_vocab_size == config.vocab_size and bool(draft.d2t.any()):
        raise ExportError(
            "d2t: the draft vocab is as large as the target's, so vLLM builds no draft-to-target mapping and "
            "would read draft id i as target id i, but this draft's d2t is not all zeros"
        )


def vllm_config(config: DraftConfig, dtype: str) -> dict:
    """The config.json vLLM (via transformers' LlamaConfig) reads for the draft."""
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        # Both spellings: transformers 5 reads rope_parameters, earlier versions (and older vLLMs) rope_theta.
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_theta": config.rope_theta, **(config.rope_scaling or {"rope_type": "default"})},
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": config.aux_layer_ids, "use_aux_hidden_state": True},
        "norm_before_residual": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    if config.target_model_type is not None:
        out["target_model_type"] = config.target_model_type  # for the reader; vLLM ignores it
    return out


def draft_config_from_vllm(data: dict, where: str) -> DraftConfig:
    if data.get("architectures") != [ARCHITECTURE]:
        raise ExportError(f"{where}: architectures is {data.get('architectures')!r}, expected [{ARCHITECTURE!r}]")
    for flag in UNSUPPORTED_FLAGS:
        if data.get(flag):
            raise ExportError(f"{where}: {flag} is set; wingspan's draft does not implement that variant")
    rope = dict(data.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", data.get("rope_theta", 10000.0))  # transformers' default
    try:
        aux_layer_ids = data["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    except (KeyError, TypeError):
        raise ExportError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids is missing") from None
    fields = [
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "target_hidden_size",
        "vocab_size",
        "draft_vocab_size",
        "num_hidden_layers",
        "rms_norm_eps",
        "max_position_embeddings",
        "hidden_act",
    ]
    missing = [name for name in fields if name not in data]
    if missing:
        raise ExportError(f"{where}: missing field(s) {missing}")
    values = {name: data[name] for name in fields} | {
        "aux_layer_ids": aux_layer_ids,
        "rope_theta": theta,
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
        "embed_injection": "first",
        "target_model_type": data.get("target_model_type"),
    }
    try:
        return from_dict(DraftConfig, values)
    except ConfigError as error:
        raise ExportError(f"{where}: {error}") from None


def export_tensors(draft: Eagle3Draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our parameter names are vLLM's; floating tensors are cast, d2t (int64) and t2d (bool) are not."""
    tensors = {}
    for name, tensor in draft.trainable_state_dict().items():
        if name == "d2t" and draft.config.draft_vocab_size == draft.config.vocab_size:
            continue  # vLLM has no mapping to load it into (see check_exportable)
        tensor = tensor.detach().cpu()
        tensors[name] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
    return tensors


def export_vllm(
    draft: Eagle3Draft,
    out_dir: str | Path,
    *,
    dtype: DtypeName = "bfloat16",
) -> Path:
    """Write `draft` to `out_dir` in vLLM's layout, verify it by loading it back, then move it into place.

    An existing `out_dir` is replaced only if it holds an earlier vLLM export (or nothing).
    """
    dtype = dtype_name(dtype)
    check_exportable(draft)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not is_vllm_export(out_dir):
        raise ExportError(f"{out_dir}: exists and is not a vLLM draft export; refusing to replace it")
    with atomic_directory(out_dir) as tmp:
        save_file(export_tensors(draft, torch_dtype(dtype)), str(tmp / WEIGHTS), metadata={"format": "pt"})
        config = vllm_config(draft.config, dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        verify_export(draft, tmp)
    return out_dir


def is_vllm_export(directory: Path) -> bool:
    try:
        return json.loads((directory / "config.json").read_text()).get("architectures") == [ARCHITECTURE]
    except (OSError, ValueError):
        return False


def load_vllm_export(directory: str | Path, embed_weight: torch.Tensor) -> Eagle3Draft:
    """Read an export back into an fp32 Eagle3Draft; every missing, unexpected or misshapen tensor is an error.

    `embed_weight` is the target's input embedding matrix, which the export (like vLLM) takes from the target.
    """
    directory = Path(directory)
    config = draft_config_from_vllm(json.loads((directory / "config.json").read_text()), str(directory / "config.json"))
    draft = Eagle3Draft(config)
    where = directory / WEIGHTS
    state = load_file(str(where))
    expected = draft.trainable_state_dict()
    if config.draft_vocab_size == config.vocab_size:
        del expected["d2t"]  # never written for a full vocab: the model's zeros are the identity
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ExportError(f"{where}: missing tensor(s) {missing}, unexpected tensor(s) {unexpected}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ExportError(
                f"{where}: {name} has shape {list(tensor.shape)}, the config needs {list(expected[name].shape)}"
            )
    draft.load_state_dict(state, strict=False)
    if tuple(embed_weight.shape) != (config.vocab_size, config.hidden_size):
        raise ExportError(
            f"embed_weight has shape {list(embed_weight.shape)}, the export needs "
            f"[{config.vocab_size}, {config.hidden_size}] (the target's input embeddings)"
        )
    draft.embed_tokens.weight.data.copy_(embed_weight)
    return draft


@torch.no_grad()
def draft_logits(draft: Eagle3Draft, seed: int = 0, length: int = 8, steps: int = 3) -> torch.Tensor:
    """Logits of a prefill over random target features and tokens, then `steps - 1` chained draft steps."""
    config = draft.config
    generator = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, length, len(config.aux_layer_ids) * config.target_hidden_size, generator=generator)
    ids = torch.randint(0, config.vocab_size, (1, length + steps), generator=generator)
    caches = new_kv_caches(draft)
    hidden = draft(draft.project_aux(aux), ids[:, :length], torch.arange(length)[None], caches)
    out = [draft.logits(hidden)]
    hidden = hidden[:, -1:]
    for j in range(1, steps):
        position = torch.tensor([[length - 1 + j]])
        hidden = draft(hidden, ids[:, length + j - 1 : length + j], position, caches)
        out.append(draft.logits(hidden))
    return torch.cat(out, dim=1)


def verify_export(draft: Eagle3Draft, directory: Path) -> None:
    """The export must compute exactly what `draft` computes with its weights cast to the export dtype
    (fp32 arithmetic on both sides), and stay within 16-bit rounding of the draft itself."""
    reference = copy.deepcopy(draft).float().eval()
    exported = load_vllm_export(directory, reference.embed_tokens.weight).eval()
    dtype = torch_dtype(json.loads((directory / "config.json").read_text())["torch_dtype"])
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
