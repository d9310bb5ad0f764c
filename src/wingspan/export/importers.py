"""Other tools' EAGLE-3 checkpoints into a wingspan draft directory, strictly: every tensor used, none missing,
shapes checked, and what our draft does not compute refused, so the result evaluates, exports and trains
(`init_from`) as our own drafts do.

Layouts, told apart by their config.json and tensor names:
- our exports: vLLM's (`layers.{n}.*`), speculators' (`speculators_model_type`), SGLang's (`midlayer.*`);
- SpecForge (main) and SGLang checkpoints: `midlayer.*` for the one layer, aux ids in SGLang's convention
  (id k = the output of layer k: ours is k + 1), read as our SGLang export is;
- the EAGLE repository's (SafeAILab/EAGLE, `eagle/model/cnets.py`, class `Model`): `midlayer.*` too, a flat
  Llama config (`architectures: ["LlamaForCausalLM"]` in `eagle/traineagle3/config.json`) without aux ids, which
  its target code fixes at the inputs of layers 2, N//2 and N-3 (`modeling_llama_kv.py`), often in
  `pytorch_model.bin`;
- SpecForge's multi-layer draft (PR 401, branch `llama3-mlp-for-draft-decoder`, `llama3_eagle.py`):
  `fuse_layer.*` for layer 0 and `additional_layers.{i}.*` for layer i + 1, whose input norm is its
  `hidden_norm` (it has no `input_layernorm`): the math of our later layers.
Where a layout records no aux ids, they are the engines' default for the target (`--target`) or given
(`--aux-layer-ids`).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import torch

from wingspan.config import TargetIdentity
from wingspan.errors import ExportError
from wingspan.export import detect_format, sglang
from wingspan.export.core import CONFIG, read_config_json, read_weights, strict_draft
from wingspan.files import atomic_directory
from wingspan.models.draft import WEIGHTS, write_draft

LEGACY_WEIGHTS = "pytorch_model.bin"
ADDITIONAL_LAYER = re.compile(r"^additional_layers\.(\d+)\.(.+)$")


def read_any_weights(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / WEIGHTS).is_file():
        return read_weights(directory / WEIGHTS)
    if (directory / LEGACY_WEIGHTS).is_file():
        try:  # tensors only: weights_only refuses pickled code
            return torch.load(directory / LEGACY_WEIGHTS, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001  (torch raises many kinds for a bad pickle)
            raise ExportError(f"{directory / LEGACY_WEIGHTS}: cannot read the weights ({error})") from None
    raise ExportError(f"{directory}: no weights ({WEIGHTS} or {LEGACY_WEIGHTS}); sharded checkpoints are not read")


def specforge_to_sglang_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SpecForge's multi-layer names to SGLang's (which read_tensors of the SGLang format turns into ours)."""
    out = {}
    for name, tensor in state.items():
        if name.startswith("fuse_layer."):
            out["midlayer." + name.removeprefix("fuse_layer.")] = tensor
        elif match := ADDITIONAL_LAYER.match(name):
            if match[2] == "input_layernorm.weight":
                raise ExportError(f"{name}: SpecForge's additional layers have no input_layernorm; unknown layout")
            out[f"layers.{int(match[1]) + 1}.{match[2]}"] = tensor
        else:
            out[name] = tensor
    return out


def target_layers(target: str) -> int:
    from transformers import AutoConfig

    from wingspan.models.registry import resolve_target

    try:
        return AutoConfig.from_pretrained(resolve_target(target)).get_text_config().num_hidden_layers
    except OSError as error:
        raise ExportError(f"--target {target}: cannot read its config ({error})") from None


def default_aux_layer_ids(target: str | None) -> list[int]:
    """What the engines capture when a draft names no aux layers: the inputs of target layers 2, N//2, N-3."""
    if target is None:
        raise ExportError(
            "the checkpoint records no aux layer ids (the engines then capture the inputs of target layers "
            "2, N//2, N-3): give --target (its N) or --aux-layer-ids"
        )
    layers = target_layers(target)
    return [2, layers // 2, layers - 3]


def sglang_style_config(data: dict, names: set[str], aux_layer_ids: list[int] | None, target: str | None) -> dict:
    """A config of the midlayer family in the SGLang export's form: the architecture vLLM and SGLang load it
    as, and explicit aux ids (SGLang's convention)."""
    data = dict(data)
    if data.get("architectures") in (None, ["LlamaForCausalLM"]):  # the EAGLE repository's training config
        data["architectures"] = ["LlamaForCausalLMEagle3"]
    recorded = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    aux_layer_ids = aux_layer_ids if aux_layer_ids is not None or recorded else default_aux_layer_ids(target)
    if aux_layer_ids is not None:
        data["eagle_config"] = {
            **(data.get("eagle_config") or {}),
            "eagle_aux_hidden_state_layer_ids": [k - 1 for k in aux_layer_ids],
        }
    return data


def read_checkpoint(source: Path, aux_layer_ids: list[int] | None, target: str | None):
    """(layout name, DraftConfig, our tensors) of an EAGLE-3 checkpoint directory."""
    if not (source / CONFIG).is_file():
        raise ExportError(f"{source}: no {CONFIG}; not a draft checkpoint")
    fmt = detect_format(source)
    data, state = read_config_json(source), read_any_weights(source)
    names = set(state)
    where = str(source / CONFIG)
    if fmt is not None and fmt.name != "sglang":
        key = "eagle_aux_hidden_state_layer_ids"
        if aux_layer_ids is None and not (data.get(key) or (data.get("eagle_config") or {}).get(key)):
            aux_layer_ids = default_aux_layer_ids(target)
        if aux_layer_ids is not None:
            data = data | (
                {key: aux_layer_ids} if fmt.name == "speculators" else {"eagle_config": {key: aux_layer_ids}}
            )
        config = fmt.read_config(data, where)
        return fmt.name, config, fmt.read_tensors(state, config, str(source))
    if any(n.startswith(("fuse_layer.", "additional_layers.")) for n in names):
        layout, state = "specforge-multilayer", specforge_to_sglang_names(state)
    elif any(n.startswith("midlayer.") for n in names):
        layout = "sglang" if fmt is not None else "eagle"
    else:
        raise ExportError(
            f"{source}: an unknown layout (no layers.*, midlayer.*, fuse_layer.* or speculators config); "
            f"first tensors: {sorted(names)[:5]}"
        )
    config = sglang.read_config(sglang_style_config(data, names, aux_layer_ids, target), where)
    return layout, config, sglang.read_tensors(state, config, str(source))


def import_draft(
    source: str | Path, out: str | Path, aux_layer_ids: list[int] | None = None, target: str | None = None
) -> tuple[str, Path]:
    """Read `source` strictly and write it as a wingspan draft directory `out`; returns the layout's name."""
    source, out = Path(source), Path(out)
    layout, config, state = read_checkpoint(source, aux_layer_ids, target)
    state = {k: v for k, v in state.items() if k != "embed_tokens.weight"}  # ours come from the target
    if target is not None:
        config.target = replace(config.target, name_or_path=target) if config.target else TargetIdentity(target)
    if config.draft_vocab_size == config.vocab_size and "t2d" not in state:
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)  # a full vocab: every target token
    placeholder = torch.zeros(config.vocab_size, config.hidden_size)
    draft = strict_draft(config, state, placeholder, str(source))
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out}: exists and is not empty; refusing to write the draft over it")
    with atomic_directory(out) as tmp:
        write_draft(tmp, draft.trainable_state_dict(), draft.config)
        (tmp / "imported.json").write_text(json.dumps({"source": str(source), "layout": layout}, indent=2) + "\n")
    return layout, out
