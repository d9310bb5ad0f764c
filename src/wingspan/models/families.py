"""What differs between target families, in one table: everything else in wingspan is family-blind.

A target's family is its config's `model_type`. The table says how its final norm scales (Gemma's
`x * (1 + w)` against Llama's `x * w`) and which serving engines run EAGLE-3 drafts for it; the config itself says
the rest (sliding windows, RoPE scaling), read here once; logit soft-capping is found by the dump, which
refuses it, by comparing the logits with lm_head(last hidden state). Multimodal wrappers are refused;
a model type outside the table runs with the Llama conventions after a warning, since that is what most
decoder-only models follow, but only the families below are tested (tests/test_families.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from wingspan.errors import ModelError


@dataclass(frozen=True)
class Family:
    name: str
    norm_offset: float = 0.0  # the final norm computes x_normalised * (norm_offset + weight)
    # the engines whose model class for this family hands aux hidden states to an EAGLE-3 draft (vLLM 0.32:
    # SupportsEagle3; SGLang 0.5: set_eagle3_layers_to_capture)
    engines: tuple[str, ...] = ("vllm", "sglang")


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama"),
    "mistral": Family("Mistral"),
    "qwen2": Family("Qwen2"),
    "qwen3": Family("Qwen3"),
    "qwen3_moe": Family("Qwen3-MoE"),
    "gpt_oss": Family("gpt-oss"),
    # vLLM's Gemma3ForCausalLM does not implement SupportsEagle3; SGLang's does capture for EAGLE-3.
    "gemma3_text": Family("Gemma3", norm_offset=1.0, engines=("sglang",)),
}
LLAMA_CONVENTIONS = Family("unlisted (Llama conventions)")


def family_of(config: Any, name: str) -> Family:
    """The family of a transformers config (`name` is the target, for messages)."""
    if config.get_text_config() is not config or hasattr(config, "vision_config"):
        raise ModelError(
            f"{name}: {config.model_type} is a multimodal wrapper; wingspan trains drafts for text-only causal LMs "
            f"(load its text model, e.g. the *ForCausalLM of {config.get_text_config().model_type})"
        )
    family = FAMILIES.get(config.model_type)
    if family is None:
        print(
            f"warning: {name}: model type {config.model_type!r} is not a tested family ({', '.join(FAMILIES)}); "
            "assuming Llama conventions (final norm x * w)",
            file=sys.stderr,
        )
        return LLAMA_CONVENTIONS
    return family


def sliding_window(config: Any) -> int | None:
    """The attention window of the target's sliding-window layers, None when every layer attends to all of its
    past. Per-layer `layer_types` (Gemma3, gpt-oss, Qwen2/3) say which layers slide; without them a set
    `sliding_window` applies to every layer (Mistral, Qwen3-MoE)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window


def rope_parameters(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) of the target's full-attention layers: scaling is transformers' `rope_parameters`
    without the theta (rope_type llama3, yarn, linear, ... and their fields), None for plain RoPE."""
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers before 5
        theta = float(getattr(config, "rope_theta", 10000.0))
        scaling = getattr(config, "rope_scaling", None)
    else:
        if "full_attention" in params:  # per layer type (Gemma3): a draft layer attends to all of its past
            params = params["full_attention"]
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return theta, None
    return theta, dict(scaling)
