"""Which process of a multi-process run this one is, read from what its launcher set: Lightning's own
launcher (LOCAL_RANK, NODE_RANK), torchrun (RANK, GROUP_RANK) or SLURM's srun (SLURM_PROCID).

Read from the environment, not from torch.distributed, because ONN writes its run record, config and
plan before any process group exists (and `task=plan` never imports torch). Lightning's DDP launcher
runs the whole command again in each extra process, so these decide which process writes the run's files.
"""

from __future__ import annotations

import os

from onn.errors import UserError

# Every variable a launcher sets to a process's rank; rank zero has all of those that are set at 0.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID")
# Set only in processes an outside launcher (torchrun, srun) or Lightning's own launcher started.
LAUNCHED_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID")


def rank_variable(name: str) -> int | None:
    """A launcher's rank variable as a number, or None where it is unset or holds no rank: empty, or -1, which
    Hugging Face's scripts and some images export to say "not distributed" (read as a rank, a run alone wrote
    none of its files, and a stray value such as "1 " ended the run in a traceback)."""
    value = os.getenv(name, "").strip()
    return int(value) if value.isdigit() else None


def rank() -> int:
    """This process's global rank as its launcher gave it (0 when it runs alone or is the first)."""
    for name in ("RANK", "SLURM_PROCID"):
        if (value := rank_variable(name)) is not None:
            return value
    local, node = rank_variable("LOCAL_RANK") or 0, rank_variable("NODE_RANK") or 0
    return local if node == 0 else max(1, node * 1000 + local)  # node > 0: not rank 0, number unknown here


def is_rank_zero() -> bool:
    """True in the one process that writes the run's record, config, plan, adapters and exports."""
    return all(rank_variable(name) in (None, 0) for name in RANK_VARIABLES)


def local_rank() -> int:
    """This process's rank on its node (0 when it runs alone): which of the node's GPUs is its own."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if (value := rank_variable(name)) is not None:
            return value
    return 0


def gpu_index() -> int:
    """This rank's GPU among those it sees: its local rank, or 0 where the launcher made one GPU visible to each
    process (SLURM's `--gpus-per-task=1`, a per-rank CUDA_VISIBLE_DEVICES), whose `cuda:LOCAL_RANK` does not
    exist."""
    index = local_rank()
    if index == 0:
        return 0
    import torch

    count = torch.cuda.device_count()
    if count == 1:
        return 0
    if index >= count > 0:
        raise UserError(
            f"this process has local rank {index} but sees {count} GPUs "
            f"(CUDA_VISIBLE_DEVICES={os.getenv('CUDA_VISIBLE_DEVICES', 'unset')}): "
            "let each process see one GPU, or all of its node's."
        )
    return index


def compute_device(accelerator: str) -> str:
    """The device this process computes on, with its index on a GPU (`gpu_index`): Lightning's single-device
    strategies and `torch.cuda.set_device` need one, and each rank of a node takes its own GPU."""
    return f"cuda:{gpu_index()}" if accelerator == "cuda" else "cpu"


def use_own_gpu() -> None:
    """Make this rank's GPU (`gpu_index`) the current CUDA device before anything touches CUDA. The
    profile, the allocator's cap and the memory readings act on the current device, which stays GPU 0 until
    Lightning's setup sets it: a rank of a multi-GPU run would otherwise cap GPU 0 instead of its own and put a
    second CUDA context (hundreds of MB) there."""
    index = gpu_index()
    if index == 0:
        return  # GPU 0 is already current
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(index)


def launched() -> bool:
    """True in a process a launcher started as one rank of several (its peers are already on their way)."""
    return any(rank_variable(name) is not None for name in LAUNCHED_VARIABLES)
