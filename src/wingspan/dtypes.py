"""The dtypes a target, a draft or an export can be in, by name: one vocabulary for every command and file.

Configs and files store the long names (`bfloat16`, `float32`, `float16`, torch's own); options also take
the short ones (`bf16`, `fp32`, `fp16`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from wingspan.errors import ConfigError

if TYPE_CHECKING:
    import torch

DtypeName = Literal["bfloat16", "float32", "float16"]
NAMES: tuple[str, ...] = ("bfloat16", "float32", "float16")
SHORT_NAMES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def dtype_name(name: str) -> str:
    """The long name of a dtype given by either name; anything else is a ConfigError."""
    long = SHORT_NAMES.get(name, name)
    if long not in NAMES:
        raise ConfigError(f"dtype {name!r}: expected one of {', '.join(NAMES)} (or {', '.join(SHORT_NAMES)})")
    return long


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, dtype_name(name))
