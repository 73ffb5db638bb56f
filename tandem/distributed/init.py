"""Process-group set-up for one rank: world = TP x PCP with TP fastest (rank = pcp_rank * TP + tp_rank).

Example, TP=2, PCP=2: TP groups {0, 1} and {2, 3}; PCP groups {0, 2} and {1, 3}; expert parallel
(when enabled) spans all four ranks.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from tandem import envs
from tandem.config import ParallelConfig
from tandem.distributed.groups import SINGLE, Group, ParallelGroups


def collective_timeout_s() -> float:
    """How long a collective may wait for a peer before the engine declares the rank dead."""
    return envs.collective_timeout_s()


def step_timeout_s() -> float:
    """How long rank 0 may take to answer one step before the engine declares the ranks hung: the watchdog behind
    the collectives' own timeout (a rank stuck outside any collective never trips that one)."""
    return envs.step_timeout_s()


def collective_timeout() -> timedelta:
    return timedelta(seconds=collective_timeout_s())


def rank_device(device: str, local_rank: int) -> str:
    """Each local rank on its own accelerator: "cuda" (or "cuda:0") -> f"cuda:{local_rank}"; CPU stays "cpu"."""
    if not device.startswith("cuda"):
        return device
    import torch

    torch.cuda.set_device(local_rank)
    return f"cuda:{local_rank}"


def init_distributed(rank: int, world_size: int, init_method: str, device: str) -> None:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=collective_timeout())


def build_groups(parallel: ParallelConfig, rank: int) -> ParallelGroups:
    """Create every TP and PCP group (all ranks must call this in the same order) and return this rank's.

    Each group gets the collective timeout explicitly: `new_group()` without one falls back to torch's 30-minute
    default, not the world group's, and a stopped peer would then hang every collective for half an hour.
    """
    tp_size, pcp_size = parallel.tensor_parallel_size, parallel.prefill_context_parallel_size
    tp_rank, pcp_rank = rank % tp_size, rank // tp_size
    tp = pcp = SINGLE
    for p in range(pcp_size):
        ranks = [p * tp_size + t for t in range(tp_size)]
        group = dist.new_group(ranks, timeout=collective_timeout()) if tp_size > 1 else None
        if p == pcp_rank and group is not None:
            tp = Group(tp_rank, tp_size, group)
    for t in range(tp_size):
        ranks = [p * tp_size + t for p in range(pcp_size)]
        group = dist.new_group(ranks, timeout=collective_timeout()) if pcp_size > 1 else None
        if t == tp_rank and group is not None:
            pcp = Group(pcp_rank, pcp_size, group)
    world = tp_size * pcp_size
    ep = Group(rank, world, dist.group.WORLD) if parallel.enable_expert_parallel and world > 1 else SINGLE
    return ParallelGroups(tp=tp, pcp=pcp, ep=ep)
