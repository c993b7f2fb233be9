"""Data-parallel training with torch.distributed, one process per device, launched by torchrun.

`torchrun --nproc-per-node N -m cloverlm train ...` sets the environment this module reads. On CUDA
the model is sharded with FSDP2 (`fully_shard`, nccl); on CPU it is replicated with DDP (gloo).
`CLOVER_PARALLEL=fsdp|ddp` forces one (FSDP2 also runs on CPU, which is how its path is tested here).

`--batch-size` stays the global batch: every rank builds the batch of step s (a pure function of
seed and step) and trains on its own contiguous slice of the rows, so N processes take the same steps
as one. Checkpoints are torch.distributed.checkpoint (DCP) shards of the model and optimizer tensors,
written as safetensors (no pickles), the rest as JSON; a run's last checkpoint also gets the full
model.safetensors from rank 0.
Without torchrun nothing here is active and training is the single-process path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from cloverlm.errors import CloverError
from cloverlm.model.checkpoint import fresh_tmp_dir, swap_in, tmp_dir

STRATEGIES = ("ddp", "fsdp")


def launched() -> bool:
    """Whether torchrun (or another launcher with its environment variables) started this process."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    """Rank 0 writes logs, JSON and exported weights; the others only write their checkpoint shards."""
    return rank() == 0


def strategy() -> str:
    chosen = os.environ.get("CLOVER_PARALLEL") or ("fsdp" if torch.cuda.is_available() else "ddp")
    if chosen not in STRATEGIES:
        raise CloverError(f"CLOVER_PARALLEL={chosen!r}: choose from {', '.join(STRATEGIES)}")
    return chosen


def init() -> torch.device:
    """Join the process group when launched by torchrun; the device this process trains on."""
    if not launched():
        return torch.device("cpu")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not active():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def shutdown() -> None:
    if active():
        dist.destroy_process_group()


def barrier() -> None:
    if active():
        dist.barrier()


def shard_rows(batch_size: int) -> slice:
    """This rank's rows of a global batch."""
    world = world_size()
    if batch_size % world:
        raise CloverError(f"--batch-size {batch_size} is not divisible by the {world} processes")
    per_rank = batch_size // world
    return slice(rank() * per_rank, (rank() + 1) * per_rank)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def from_main(value: float) -> float:
    """Rank 0's value on every rank: decisions from timings or evaluations must agree, or ranks deadlock."""
    if not active():
        return value
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=_comm_device())
    dist.broadcast(tensor, src=0)
    return float(tensor)


def batch_mean(loss: float, accuracy: float, scored: int) -> tuple[float, float]:
    """The whole batch's loss (each rank's is an estimate of it from its rows) and accuracy (per scored token)."""
    totals = torch.tensor([loss, accuracy * scored, scored], dtype=torch.float64, device=_comm_device())
    all_reduce_sum(totals)
    return float(totals[0]) / world_size(), float(totals[1]) / max(float(totals[2]), 1.0)


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


class _DDP(DistributedDataParallel):
    """DDP that still answers `model.config` and the model's own methods, which the losses read."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def wrap(model: torch.nn.Module) -> torch.nn.Module:
    """What the training forward runs: an FSDP2-sharded `model` (in place) or a DDP wrapper around it.

    Evaluation, optimizer and checkpoints use `model` itself.
    """
    for block in getattr(model, "moe_blocks", list)():
        block.reduce_load = all_reduce_sum
    if strategy() == "fsdp":
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        for layer in model.model.layers:  # one all-gather per layer keeps peak memory at one layer's weights
            fully_shard(layer)
            if hasattr(layer, "forward_streams"):  # Clover calls this, not forward: FSDP must hook it too
                register_fsdp_forward_method(layer, "forward_streams")
        fully_shard(model)  # the rest: embeddings, tied lm_head, final norm
        return model
    # Buffers (the routing bias) are kept equal by reduce_load, so DDP need not broadcast them every step.
    return _DDP(model, forward_sync_buffers=False)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


# ----------------------------------------------------------------------------------------------
# Checkpoints

SHARDS = "shards"  # the sharded tensors' subfolder of a checkpoint (one safetensors file per rank)


def save_sharded(
    target: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    write_main: Callable[[Path, list, dict | None], None],
    full: bool,
) -> None:
    """A checkpoint folder, swapped in atomically like the single-process one: every rank's DCP shards
    of the model and optimizer tensors, then write_main(folder, param_groups, full_state) on rank 0.

    full=True gathers the whole model state for rank 0 (the final export); otherwise it is None.
    Collective: every rank must call it.
    """
    target = Path(target)
    model_state, optim_state = get_state_dict(model, optimizer)
    model_state = _without_tied(model_state)
    tmp = fresh_tmp_dir(target) if is_main() else tmp_dir(target)
    barrier()
    # Tensors only, as safetensors shards whose headers carry DCP's sharding metadata: DCP's default
    # writer would add a pickled `.metadata` file, and cloverlm never loads pickles. The hyperparameters
    # go to JSON.
    dcp.save(
        {"model": model_state, "optimizer": optim_state["state"]},
        storage_writer=HuggingFaceStorageWriter(str(tmp / SHARDS), save_distributed=True),
    )
    state = full_state_dict(model) if full else None
    if is_main():
        write_main(tmp, optim_state["param_groups"], state)
    barrier()  # every rank's shards are on disk (DCP fsyncs each file) before the swap
    if is_main():
        swap_in(tmp, target)
    barrier()


def load_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, param_groups: list) -> None:
    """Fill `model` and `optimizer` from a DCP checkpoint, resharded to this run's world size (1 works too)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": _without_tied(model_state), "optimizer": optim_state["state"]}
    # DCP loads in place, so filling a tied tensor under its first name fills `model_state` under both.
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(Path(folder) / SHARDS)))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict={"state": state["optimizer"], "param_groups": param_groups},
    )


def _without_tied(state: dict) -> dict:
    """The state without second names for one tensor (tied embeddings): safetensors refuses to store
    shared memory twice, and loading the first name fills both."""
    seen, kept = set(), {}
    for name, tensor in state.items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
        if key not in seen:
            seen.add(key)
            kept[name] = tensor
    return kept


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model state on rank 0's CPU ({} on the other ranks); collective under FSDP."""
    if not active():
        return model.state_dict()
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
