"""Data parallelism under torchrun: N processes run the one training loop, each on its share of every step.

`torchrun --nproc-per-node N -m wingspan train ...` starts N processes with RANK, WORLD_SIZE and LOCAL_RANK
set; `process_group(device)` joins them (gloo on CPU, NCCL with one GPU per process). Without torchrun there is no
process group, `current_world()` is a world of one, and nothing here changes the single-process run.

Every rank plans the same micro-batches (the plan is a pure function of seed and epoch) and runs a
round-robin share of each optimizer step's `grad_accum` of them, so N processes see exactly the data one
process sees; see `share_of_step` for the arithmetic that makes the summed gradient the one-process gradient.
The draft is replicated (DDP) or sharded per decoder layer (FSDP2, `parallel: fsdp`, for drafts too large to
replicate with their gradients and AdamW state). Checkpoints hold the full, unsharded
state in the single-process format, written by rank 0, so a run saved on N processes resumes on any M.
"""

from __future__ import annotations

import faulthandler
import math
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from wingspan.data.batching import MicroBatch
from wingspan.models.draft import Eagle3Draft

# Gathered full tensors land on rank 0's CPU only, the other ranks get nothing: a checkpoint never needs
# the whole model on a device, nor on every rank.
FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)


@dataclass(frozen=True)
class World:
    """This process's place among the ranks; `World()` is the single-process run."""

    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of `tensor` over the ranks (a copy; `tensor` itself on a single process)."""
        if self.size == 1:
            return tensor
        total = tensor.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


@contextmanager
def process_group(device: torch.device) -> Iterator[World]:
    """Join torchrun's process group for the duration of a command (a world of one without torchrun): NCCL
    when the ranks train on their GPUs (`device`, from `wingspan.devices.resolve_device`), gloo on CPUs."""
    if not launched_by_torchrun():
        yield World()
        return
    # A rank that dies in native code (gloo, NCCL, a C++ thread at exit) says only "terminate called" and its
    # signal; this prints where each of its Python threads was, in the stderr torchrun forwards.
    faulthandler.enable(all_threads=True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield current_world()
    finally:
        dist.destroy_process_group()


def current_world() -> World:
    return World(dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else World()


def print0(*args, **kwargs) -> None:
    """print on rank 0 only: N copies of every message say nothing more."""
    if current_world().is_main:
        print(*args, **kwargs)


# ------------------------------------------------------------------------------------------- data


def share_of_step(group: list[MicroBatch], world: World) -> list[tuple[MicroBatch, float]]:
    """This rank's (micro-batch, loss scale) pairs of one optimizer step's micro-batches `group`.

    Round-robin: rank r takes micro-batches r, r + N, ... Each loss is already divided by the token counts
    of the whole group (the trainer's `normaliser`), so the one-process gradient is the *sum* of the ranks'
    gradients; DDP and FSDP average them, hence the scale N. DDP and FSDP also need every rank to run the
    same number of backward passes, so a rank short of one when N does not divide the group runs the
    group's first micro-batch again at scale 0: its gradient is zero and its metrics are not counted.
    """
    mine = group[world.rank :: world.size]
    passes = math.ceil(len(group) / world.size)
    return [(micro, float(world.size)) for micro in mine] + [(group[0], 0.0)] * (passes - len(mine))


# ------------------------------------------------------------------------------------------- model


def parallelize(model: nn.Module, draft: Eagle3Draft, parallel: str, world: World, device: torch.device) -> nn.Module:
    """`model` (whose forward runs `draft`) wrapped for `world`: itself on one process, else DDP or FSDP2.

    FSDP2 shards each decoder layer on its own (gathered only while it computes) and the rest of the draft
    (fc, norm, lm_head, frozen embeddings) with `model` as the root. The ranks must start from the same
    weights, as they do: same seed, same checkpoint. Build the optimizer after this call: FSDP2 replaces
    the parameters by sharded ones.
    """
    if world.size == 1:
        return model
    if parallel == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (world.size,))
    for layer in draft.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def gradient_sync(model: nn.Module, last: bool) -> AbstractContextManager:
    """Around a micro-batch's forward and backward: DDP all-reduces gradients on the step's last one only.

    FSDP2 reduce-scatters every micro-batch: deferring it would keep unsharded gradients between
    micro-batches, the memory FSDP is there to save.
    """
    if isinstance(model, DistributedDataParallel) and not last:
        return model.no_sync()
    return nullcontext()


def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ (which FSDP's sharded gradients go through as they are), returning the norm
    before clipping as a plain tensor, the same on every rank."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _is_sharded(draft: Eagle3Draft) -> bool:
    return isinstance(draft.layers[0], FSDPModule)


# ------------------------------------------------------------------------------------------- state


def full_weights(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The draft's trainable state (all but the frozen embeddings), whole, on rank 0; {} on other ranks.
    Under FSDP every rank must call it (it gathers)."""
    if _is_sharded(draft):
        return get_model_state_dict(draft, options=FULL_ON_RANK0)
    return draft.trainable_state_dict() if current_world().is_main else {}


def full_optimizer_state(draft: Eagle3Draft, optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` of the whole model (parameters numbered as in a single-process run) on rank 0;
    {} on other ranks. Under FSDP every rank must call it (it gathers)."""
    if not _is_sharded(draft):
        return optimizer.state_dict() if current_world().is_main else {}
    state = get_optimizer_state_dict(draft, optimizer, options=FULL_ON_RANK0)
    if not state:
        return {}
    number = {name: i for i, name in enumerate(_trainable_names(draft))}
    return {
        "state": {number[name]: entry for name, entry in state["state"].items()},
        "param_groups": [dict(group, params=[number[n] for n in group["params"]]) for group in state["param_groups"]],
    }


def load_optimizer_state(draft: Eagle3Draft, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a full `optimizer.state_dict()` (as `full_optimizer_state` returns) on every rank; under FSDP each
    rank keeps its own shard of it."""
    if not _is_sharded(draft):
        optimizer.load_state_dict(state)
        return
    names = _trainable_names(draft)
    by_name = {
        "state": {names[index]: entry for index, entry in state["state"].items()},
        "param_groups": [dict(group, params=[names[i] for i in group["params"]]) for group in state["param_groups"]],
    }
    set_optimizer_state_dict(draft, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def _trainable_names(draft: Eagle3Draft) -> list[str]:
    """Names in the order the trainer hands the parameters to its optimizer: the numbering of its state."""
    return [name for name, p in draft.named_parameters() if p.requires_grad]
