"""Multi-rank CUDA's choices, checked on a CPU (one GPU is lent at most, never two): each local rank takes its own
device and NCCL; every other device keeps gloo. The collectives themselves are the same calls the gloo suites run
(tests/test_multirank.py and the PCP suites) on tensors of the rank's device."""

from __future__ import annotations

import pytest

from tandem.distributed import init


def test_each_local_rank_takes_its_own_cuda_device(monkeypatch):
    chosen: list[int] = []
    monkeypatch.setattr("torch.cuda.set_device", chosen.append)
    assert init.rank_device("cuda", 0) == "cuda:0"
    assert init.rank_device("cuda:0", 3) == "cuda:3"
    assert chosen == [0, 3]
    assert init.rank_device("cpu", 2) == "cpu"
    assert chosen == [0, 3], "a CPU rank selects no accelerator"


@pytest.mark.parametrize("device,backend", [("cuda:1", "nccl"), ("cuda", "nccl"), ("cpu", "gloo")])
def test_cuda_ranks_join_nccl_and_cpu_ranks_gloo(monkeypatch, device, backend):
    calls: list[tuple[str, dict]] = []
    monkeypatch.setattr(init.dist, "init_process_group", lambda b, **kw: calls.append((b, kw)))
    init.init_distributed(1, 2, "tcp://127.0.0.1:1", device)
    assert calls[0][0] == backend
    assert calls[0][1]["rank"] == 1 and calls[0][1]["world_size"] == 2
    assert calls[0][1]["timeout"] == init.collective_timeout(), "NCCL gets the collective timeout gloo gets"
