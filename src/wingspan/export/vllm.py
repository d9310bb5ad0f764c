"""vLLM's EAGLE-3 layout (`LlamaForCausalLMEagle3`, any depth).

What vLLM 0.32's `llama_eagle3.py` does with the files, and why the export looks the way it does:
- Its weight loader is not strict: `Eagle3LlamaForCausalLM.load_weights` returns None, so vLLM's check
  that every parameter was loaded never runs and a missing tensor silently stays uninitialised. An
  unexpected name is an error there. Hence every export is read back strictly.
- It builds `hidden_norm` in every layer but reads it only in layer 0; later layers keep vLLM's own
  initial value, so nothing is written for them (our later layers have no hidden_norm).
- It skips every tensor whose name contains `t2d`; `d2t` is loaded only when draft_vocab_size differs
  from the target's vocab size. With equal sizes it builds no mapping and rejects a `d2t` tensor.
- `embed_tokens` is optional: without it vLLM shares the target's embedding (when the widths agree),
  which is what the draft was trained with, so it is not exported.
- RoPE comes from the draft's own config (`rope_parameters` in transformers 5, `rope_theta` before),
  scaled RoPE (llama3, yarn, linear) included.
- The target must implement vLLM's SupportsEagle3 (hand aux hidden states to the draft); Gemma3 does not.
- Aux id k is the input of target layer k (our convention); `norm_before_residual` is written false, which
  is what we compute (vLLM reads it from a speculators config only, where absent means true).
- A parallel draft carries `mask_token_id` at the top level of config.json (vLLM looks there, not in
  eagle_config) and the `mask_hidden` tensor [3 * target hidden] (any name containing it loads); vLLM runs it
  with `"parallel_drafting": true` in the speculative config, which nothing in the files turns on.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch

from wingspan.config import DraftConfig
from wingspan.dtypes import torch_dtype
from wingspan.errors import ExportError
from wingspan.export.core import (
    ExportSettings,
    Format,
    check_served,
    draft_config_from_llama,
    identity_fields,
    identity_from,
    llama_fields,
    our_tensors,
    refuse_variants,
    save_export,
    served_target,
)
from wingspan.models.draft import Eagle3Draft

ARCHITECTURE = "LlamaForCausalLMEagle3"


def check(draft: Eagle3Draft) -> None:
    check_served(draft, "vllm", "vLLM 0.32")


def config_json(config: DraftConfig, dtype: str) -> dict:
    """The config.json vLLM (via transformers' LlamaConfig) reads for the draft."""
    return {
        "architectures": [ARCHITECTURE],
        **llama_fields(config),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": config.aux_layer_ids, "use_aux_hidden_state": True},
        "norm_before_residual": False,
        "torch_dtype": dtype,
        **identity_fields(config),
        **({"mask_token_id": config.mask_token_id} if config.draft_mode == "parallel" else {}),
        # what we know and vLLM does not read: the tokens per round a parallel draft was trained for
        **({"wingspan_parallel_tokens": config.num_parallel_tokens} if config.num_parallel_tokens else {}),
    }


def write(draft: Eagle3Draft, directory: Path, settings: ExportSettings) -> None:
    save_export(directory, config_json(draft.config, settings.dtype), our_tensors(draft, torch_dtype(settings.dtype)))


def speculative_config(config: DraftConfig, directory: Path, num_speculative_tokens: int) -> dict:
    """vLLM's --speculative-config for the export in `directory` (a parallel draft's turns parallel drafting on)."""
    speculative = {"method": "eagle3", "model": str(directory), "num_speculative_tokens": num_speculative_tokens}
    if config.draft_mode == "parallel":
        speculative["parallel_drafting"] = True
    return speculative


def serve(config: DraftConfig, directory: Path, settings: ExportSettings) -> str:
    speculative = speculative_config(config, directory, config.draft_tokens(settings.speculative_tokens))
    target = served_target(config, settings) or "TARGET"
    return f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(speculative))}"


def aux_layer_ids(data: dict, where: str) -> list[int]:
    ids = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = ids or data.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise ExportError(
            f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids is missing (the engines' default, "
            "[2, N//2, N-3], depends on the target: give it with `wingspan import --aux-layer-ids`)"
        )
    return ids


def read_config(data: dict, where: str) -> DraftConfig:
    if data.get("architectures") != [ARCHITECTURE]:
        raise ExportError(f"{where}: architectures is {data.get('architectures')!r}, expected [{ARCHITECTURE!r}]")
    refuse_variants(data, where)
    if data.get("norm_before_residual"):
        raise ExportError(f"{where}: norm_before_residual is set; wingspan's draft does not implement that variant")
    extra = {
        "aux_layer_ids": aux_layer_ids(data, where),
        "target": identity_from(data, where),
    }
    extra |= {k: data[k] for k in ("draft_vocab_size", "target_hidden_size") if data.get(k) is not None}
    if data.get("mask_token_id") is not None:
        extra |= {"draft_mode": "parallel", "mask_token_id": data["mask_token_id"]}
        extra |= {"num_parallel_tokens": data.get("wingspan_parallel_tokens")}
    return draft_config_from_llama(data, extra, where)


def read_tensors(state: dict[str, torch.Tensor], config: DraftConfig, where: str) -> dict[str, torch.Tensor]:
    return state  # our names are vLLM's


def recognises(data: dict, names: set[str]) -> bool:
    return data.get("architectures") == [ARCHITECTURE] and any(n.startswith("layers.0.") for n in names)


FORMAT = Format(
    name="vllm",
    engines="vLLM (--speculative-config method eagle3)",
    check=check,
    write=write,
    recognises=recognises,
    read_config=read_config,
    read_tensors=read_tensors,
    serve=serve,
)
