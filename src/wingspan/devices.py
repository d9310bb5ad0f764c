"""Where a command runs its models: one `device` setting (auto | cpu | cuda | cuda:N) for every command.

`auto` takes the GPU when there is one (under torchrun, the rank's LOCAL_RANK GPU), else the CPU. The choice
and the dtype are printed when a command starts, so a run never trains on the CPU by surprise.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys

import torch

from wingspan.errors import ConfigError

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
DEVICE_HELP = "auto (the GPU when there is one, else the CPU), cpu, cuda or cuda:N"


def device_name(name: str) -> str:
    """`name` if it is a device setting, else a ConfigError (the check behind every --device and `device`)."""
    if not isinstance(name, str) or not DEVICE_PATTERN.match(name):
        raise ConfigError(f"device {name!r}: expected {DEVICE_HELP}")
    return name


def resolve_device(name: str) -> torch.device:
    """The torch device of a setting. Under torchrun `auto` and `cuda` take the rank's LOCAL_RANK GPU; asking
    for a GPU that is not there is an error, not a quiet fall back to the CPU."""
    device_name(name)
    if name == "cpu":
        return torch.device("cpu")
    if name == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {name!r}: torch sees no CUDA GPU here (torch {torch.__version__}); use device=cpu")
    if name in ("auto", "cuda"):
        local_rank = os.environ.get("LOCAL_RANK")
        return torch.device("cuda", int(local_rank) if local_rank is not None else torch.cuda.current_device())
    index = int(name.split(":")[1])
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return torch.device("cuda", index)


def describe(device: torch.device) -> str:
    """The device as the start-up line names it: the GPU's model, or the CPU's vector capability."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads)"


def announce(what: str, device: torch.device, dtype: torch.dtype) -> None:
    """The start-up line every command that runs a model prints (on stderr: stdout may be a result)."""
    print(f"{what}: device {describe(device)}, dtype {str(dtype).removeprefix('torch.')}", file=sys.stderr)


def use_cpu_threads(device: torch.device, threads: int | None) -> None:
    """torch's CPU thread count, when the work runs on the CPU (on a GPU it only slows the data loader)."""
    if threads and device.type == "cpu":
        torch.set_num_threads(threads)


def start_vector_math() -> None:
    """Make the process's first call into torch's CPU vector math (MKL's VML, behind exp, cos, sin, log, tanh
    and others) on one element, so from one thread, before any model runs (`TargetModel.load` calls it). When
    the first call is a large one, split between OpenMP threads, one thread's share is sometimes computed less
    accurately, in some processes and not others, and two runs of the same command then differ from the RoPE
    of their first step (docs/reliability.md, "Run to run on the CPU"). Later calls are not affected."""
    torch.ones(1).exp()


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # musl and other C libraries: nothing to do
        return None


_LIBC = _glibc()


def release_freed_memory() -> None:
    """Hand the pages of freed CPU tensors back to the system (glibc's malloc_trim). A CPU training loop
    allocates tensors of a different size every step; glibc keeps the freed ones resident, so the process grows
    step after step (docs/training.md, "Memory on the CPU"). Elsewhere a no-op."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
