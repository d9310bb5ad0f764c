"""SGLang's EAGLE-3 layout, as SGLang 0.5's `llama_eagle3.py` (`LlamaForCausalLMEagle3`) loads it.

What its code does, and what the export writes for it:
- Names: layer 0 as `midlayer.*` (SpecForge's name, which SGLang maps to `layers.0`), later layers as
  `layers.{n}.*`; q/k/v and gate/up are stacked by its loader. Its loader skips every name it does not
  declare without a word, so the export never relies on it to complain.
- Later layers: its forward normalises a later layer's input with that layer's `hidden_norm` (fused with the
  residual add) and never reads its `input_layernorm`; the math is the pre-norm Llama layer ours is, so our
  `input_layernorm` of layer n >= 1 is written as `layers.{n}.hidden_norm` (and, for any version that reads
  the other one, as `layers.{n}.input_layernorm` too).
- Aux ids: its id k is the output of target layer k (it captures the input of layer k + 1), ours the input,
  so it gets ours minus one; our id 0 (the embedding output) has no SGLang id and is refused.
- `d2t` gives its hot-token map; `t2d` is skipped; `embed_tokens` comes from the target when absent.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import torch

from wingspan.config import DraftConfig
from wingspan.dtypes import torch_dtype
from wingspan.errors import ExportError
from wingspan.export import vllm
from wingspan.export.core import (
    ExportSettings,
    Format,
    check_served,
    our_tensors,
    refuse_parallel,
    save_export,
    served_target,
)
from wingspan.models.draft import Eagle3Draft

LATER_LAYER_NORM = re.compile(r"^layers\.([1-9]\d*)\.input_layernorm\.weight$")
SGLANG_LATER_NORM = re.compile(r"^layers\.([1-9]\d*)\.(hidden_norm|input_layernorm)\.weight$")


def check(draft: Eagle3Draft) -> None:
    check_served(draft, "sglang", "SGLang 0.5")
    refuse_parallel(draft, "sglang")
    if 0 in draft.config.aux_layer_ids:
        raise ExportError(
            f"aux_layer_ids {draft.config.aux_layer_ids}: id 0 is the target's embedding output, which SGLang "
            "cannot capture (its id k is the output of layer k, so our id k is its k - 1)"
        )


def config_json(config: DraftConfig, dtype: str) -> dict:
    out = vllm.config_json(config, dtype)
    out["eagle_config"] = {
        "eagle_aux_hidden_state_layer_ids": [k - 1 for k in config.aux_layer_ids],
        "use_aux_hidden_state": True,
    }
    return out


def export_tensors(draft: Eagle3Draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, tensor in our_tensors(draft, dtype).items():
        if name.startswith("layers.0."):
            tensors["midlayer." + name.removeprefix("layers.0.")] = tensor
        elif LATER_LAYER_NORM.match(name):
            tensors[name.replace("input_layernorm", "hidden_norm")] = tensor
            tensors[name] = tensor.clone()
        else:
            tensors[name] = tensor
    return tensors


def write(draft: Eagle3Draft, directory: Path, settings: ExportSettings) -> None:
    config = config_json(draft.config, settings.dtype)
    save_export(directory, config, export_tensors(draft, torch_dtype(settings.dtype)))


def read_config(data: dict, where: str) -> DraftConfig:
    config = vllm.read_config(data, where)
    config.aux_layer_ids = [k + 1 for k in config.aux_layer_ids]
    return config


def read_tensors(state: dict[str, torch.Tensor], config: DraftConfig, where: str) -> dict[str, torch.Tensor]:
    """SGLang's names to ours; a later layer's input norm is its hidden_norm (what SGLang computes with)."""
    ours, later_norms = {}, {}
    for name, tensor in state.items():
        if name.startswith("midlayer."):
            ours["layers.0." + name.removeprefix("midlayer.")] = tensor
        elif match := SGLANG_LATER_NORM.match(name):
            later_norms.setdefault(int(match[1]), {})[match[2]] = tensor
        elif name.startswith("layers.0."):
            raise ExportError(f"{where}: {name}: layer 0 is named midlayer.* in this layout, not layers.0.*")
        else:
            ours[name] = tensor
    for layer in range(1, config.num_hidden_layers):
        norms = later_norms.pop(layer, {})
        if "hidden_norm" not in norms:
            raise ExportError(
                f"{where}: layers.{layer}.hidden_norm.weight is missing: SGLang normalises layer {layer}'s input "
                "with it (and never reads its input_layernorm)"
            )
        ours[f"layers.{layer}.input_layernorm.weight"] = norms["hidden_norm"]
    for layer, norms in later_norms.items():  # beyond the config's depth: strict_draft names them
        ours |= {f"layers.{layer}.{kind}.weight": tensor for kind, tensor in norms.items()}
    return ours


def recognises(data: dict, names: set[str]) -> bool:
    return data.get("architectures") == [vllm.ARCHITECTURE] and any(n.startswith("midlayer.") for n in names)


def serve(config: DraftConfig, directory: Path, settings: ExportSettings) -> str:
    k = config.draft_tokens(settings.speculative_tokens)
    return (
        f"python -m sglang.launch_server --model {shlex.quote(served_target(config, settings) or 'TARGET')} "
        f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {shlex.quote(str(directory))} "
        f"--speculative-num-steps {k} "
        f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
    )


FORMAT = Format(
    name="sglang",
    engines="SGLang (--speculative-algorithm EAGLE3), SpecForge",
    check=check,
    write=write,
    recognises=recognises,
    read_config=read_config,
    read_tensors=read_tensors,
    serve=serve,
)
