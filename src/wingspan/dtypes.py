"""The dtypes a target, a draft or an export can be in, by name: one vocabulary for every command and file.

Configs and files store the long names (`bfloat16`, `float32`, `float16`, torch's own); options also take
the short ones (`bf16`, `fp32`, `fp16`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

from wingspan.errors import ConfigError

if TYPE_CHECKING:
    import torch

DtypeName = Literal["bfloat16", "float32", "float16"]
NAMES: tuple[str, ...] = get_args(DtypeName)
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


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (AVX-512 or AMX on x86, SVE on Arm). Without it (AVX2 only)
    torch falls back to a reference kernel, many times slower than float32 (docs/training.md has the figures)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return capability.startswith(("AVX512", "AMX", "SVE"))


def slow_dtype_warning(dtype: torch.dtype, device: torch.device) -> str | None:
    """A warning when 16-bit weights would run on a CPU without native support for them, else None."""
    import torch

    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16) or cpu_has_fast_bf16():
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"warning: this CPU ({capability}) has no native {str(dtype).removeprefix('torch.')} matmul, so the model "
        "runs many times slower than in float32; choose float32 (--dtype float32, target_dtype=float32) here"
    )
