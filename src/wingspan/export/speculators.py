"""The speculators layout (vLLM's training library, `speculators_model_type: eagle3`), which vLLM serves
directly: `vllm serve DIR` reads the target from the verifier fields, or `--speculative-config` names DIR.

As speculators 0.9's `Eagle3DraftModel` saves it: the weights under our (vLLM's) names, `embed_tokens` left
out (it is in the model's `_keys_to_ignore_on_load_missing`: the verifier's embeddings are loaded), and a
config of `transformer_layer_config` (a LlamaConfig of the draft's layers; its `vocab_size` is the target's),
`draft_vocab_size`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (the input of target layer k, as
ours) and `speculators_config` (algorithm, proposal methods, verifier). `norm_before_residual` is always
written: vLLM takes it as true when absent, speculators as false. A full draft vocab (draft_vocab_size equal
to the target's) has no d2t/t2d there: speculators registers neither buffer for it.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import torch

from wingspan.config import DraftConfig, TargetIdentity
from wingspan.dtypes import torch_dtype
from wingspan.errors import ExportError
from wingspan.export.core import (
    ExportSettings,
    Format,
    check_served,
    draft_config_from_llama,
    llama_fields,
    our_tensors,
    refuse_parallel,
    refuse_variants,
    save_export,
    served_target,
)
from wingspan.models.draft import Eagle3Draft

VERSION = "0.9.0"  # the speculators release whose classes the tests load exports with


def check(draft: Eagle3Draft) -> None:
    check_served(draft, "vllm", "vLLM 0.32 (which serves speculators drafts)")
    refuse_parallel(draft, "speculators")


def verifier(config: DraftConfig, settings: ExportSettings) -> dict:
    name = served_target(config, settings)
    if name is None:
        raise ExportError(
            "the speculators format names the target (speculators_config.verifier); this draft does not record "
            "its target: give it with --target NAME_OR_PATH"
        )
    architectures = config.target.architectures if config.target else []
    return {"name_or_path": name, "architectures": architectures}


def config_json(config: DraftConfig, settings: ExportSettings) -> dict:
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": config.draft_tokens(settings.speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": verifier(config, settings),
        },
        "transformer_layer_config": llama_fields(config),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": config.aux_layer_ids,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": settings.dtype,
    }


def export_tensors(draft: Eagle3Draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors = our_tensors(draft, dtype)
    if draft.config.draft_vocab_size == draft.config.vocab_size:
        tensors.pop("t2d")  # no buffer to load it into (see the module's docstring)
    return tensors


def write(draft: Eagle3Draft, directory: Path, settings: ExportSettings) -> None:
    save_export(directory, config_json(draft.config, settings), export_tensors(draft, torch_dtype(settings.dtype)))


def read_config(data: dict, where: str) -> DraftConfig:
    if data.get("speculators_model_type") != "eagle3":
        raise ExportError(
            f"{where}: speculators_model_type is {data.get('speculators_model_type')!r}; only eagle3 drafts are "
            "read (a peagle draft is parallel drafting)"
        )
    refuse_variants(data, where)
    if "norm_before_residual" not in data:
        raise ExportError(
            f"{where}: norm_before_residual is absent, which vLLM reads as true and speculators as false; "
            "set it to what the draft was trained with"
        )
    if data.get("embed_requires_grad"):
        raise ExportError(f"{where}: embed_requires_grad is set; wingspan's draft uses the target's embeddings, frozen")
    if data["norm_before_residual"]:
        raise ExportError(f"{where}: norm_before_residual is set; wingspan's draft does not implement that variant")
    layer = data.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ExportError(f"{where}: transformer_layer_config is missing")
    ids = data.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise ExportError(
            f"{where}: eagle_aux_hidden_state_layer_ids is missing (speculators' default depends on the target: "
            "give the ids with `wingspan import --aux-layer-ids`)"
        )
    verifier_fields = (data.get("speculators_config") or {}).get("verifier") or {}
    target = None
    if verifier_fields.get("name_or_path"):
        target = TargetIdentity(verifier_fields["name_or_path"], architectures=verifier_fields.get("architectures", []))
    extra = {"aux_layer_ids": ids, "target": target, "draft_vocab_size": data.get("draft_vocab_size")}
    if data.get("target_hidden_size") is not None:
        extra["target_hidden_size"] = data["target_hidden_size"]
    return draft_config_from_llama(layer, extra, where)


def read_tensors(state: dict[str, torch.Tensor], config: DraftConfig, where: str) -> dict[str, torch.Tensor]:
    state = dict(state)
    state.pop("embed_tokens.weight", None)  # speculators saves the verifier's; ours come from the target
    if config.draft_vocab_size == config.vocab_size:
        state.setdefault("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
    return state


def recognises(data: dict, names: set[str]) -> bool:
    return "speculators_model_type" in data


def serve(config: DraftConfig, directory: Path, settings: ExportSettings) -> str:
    verifier = served_target(config, settings)
    return f"vllm serve {shlex.quote(str(directory))}  # the target: the export's verifier, {verifier}"


FORMAT = Format(
    name="speculators",
    engines="vLLM (vllm serve DIR), speculators",
    check=check,
    write=write,
    recognises=recognises,
    read_config=read_config,
    read_tensors=read_tensors,
    serve=serve,
)
