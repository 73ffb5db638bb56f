"""Multi-rank executor: the engine process schedules; ranks 0..W-1 are spawned worker processes.

Control plane: each StepPlan is pickled down a pipe to every rank, and rank 0 sends the StepOutput
back (all ranks sample identical tokens). Idle workers wait on their pipe, so there is no timeout
to trip between requests, and they exit when the engine process disappears. Data plane: tensors
move over torch.distributed (gloo on CPU, NCCL on CUDA), whose collectives time out. A rank that
raises, dies or hangs ends the engine with EngineDeadError naming it, and every rank is reaped.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.distributed.init import build_groups, collective_timeout_s, free_loopback_port, init_distributed
from tandem.engine.step_plan import StepOutput, StepPlan
from tandem.worker.model_runner import ModelRunner

_POLL_S = 0.2


class EngineDeadError(RuntimeError):
    """A rank failed; the engine cannot continue."""


def _set_up_rank(config: EngineConfig, rank: int, init_method: str) -> ModelRunner:
    init_distributed(rank, config.parallel_config.world_size, init_method, config.device)
    runner = ModelRunner(config, build_groups(config.parallel_config, rank))
    # Every rank must agree on the pool size: take the smallest any rank can hold.
    num_blocks = torch.tensor([runner.num_kv_blocks()])
    dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN)
    runner.allocate_kv_cache(int(num_blocks))
    return runner


def _worker_main(config: EngineConfig, rank: int, init_method: str, conn: Connection, threads: int) -> None:
    torch.set_num_threads(threads)
    parent = os.getppid()
    try:
        runner = _set_up_rank(config, rank, init_method)
        conn.send(("ready", runner.num_blocks))
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent:
                    os._exit(0)  # the engine died: do not outlive it
                continue
            plan = conn.recv()
            if plan is None:
                break
            output = runner.execute(plan)
            if rank == 0:
                conn.send(("output", output))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        os._exit(0)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except (BrokenPipeError, OSError):
            pass
        os._exit(1)  # skip torch.distributed teardown, which may block on dead peers
    dist.destroy_process_group()


class MultiprocExecutor:
    def __init__(self, config: EngineConfig):
        world = config.parallel_config.world_size
        init_method = f"tcp://127.0.0.1:{free_loopback_port()}"
        threads = max(1, torch.get_num_threads() // world) if config.device == "cpu" else 1
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        for rank in range(world):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(config, rank, init_method, child_conn, threads),
                               name=f"tandem-rank{rank}", daemon=True)
            proc.start()
            self.procs.append(proc)
            self.conns.append(parent_conn)
        atexit.register(self.shutdown)
        self._dead = False
        # Loading weights can take a while; the start-up deadline is generous.
        ready = [self._receive(rank, "ready", time.monotonic() + 60 + 4 * collective_timeout_s())
                 for rank in range(world)]
        self.num_kv_blocks = int(ready[0])

    def execute(self, plan: StepPlan) -> StepOutput:
        if self._dead:
            raise EngineDeadError("the engine stopped after a rank failure; create a new LLM")
        for rank, conn in enumerate(self.conns):
            self._checked(rank, lambda c=conn: c.send(plan))
        return self._receive(0, "output", None)

    def _receive(self, rank: int, expected: str, deadline: float | None) -> Any:
        """Wait for `expected` from `rank` while watching every rank for death or a reported error."""
        while True:
            if self._checked(rank, lambda: self.conns[rank].poll(_POLL_S)):
                kind, payload = self._checked(rank, self.conns[rank].recv)
                if kind == expected:
                    return payload
                raise self._failure(f"rank {rank} raised:\n{payload}")
            for other, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True)):
                # During steps only rank 0 answers, so anything on another pipe is an error report.
                reported = expected == "output" and other != rank and conn.poll(0)
                if not proc.is_alive() or reported:
                    raise self._failure(f"rank {other} stopped")
            if deadline is not None and time.monotonic() > deadline:
                raise self._failure(f"rank {rank} did not answer in time")

    def _checked(self, rank: int, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as e:
            raise self._failure(f"rank {rank} is gone ({type(e).__name__})") from e

    def _failure(self, fallback: str) -> EngineDeadError:
        """Name the rank(s) that failed (a reported traceback or an exit code), then reap every rank."""
        time.sleep(_POLL_S)  # let a crashing rank finish reporting
        reasons = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True)):
            try:
                if conn.poll(0):
                    kind, detail = conn.recv()
                    if kind == "error":
                        reasons.append(f"rank {rank} raised:\n{detail}")
                        continue
            except (EOFError, OSError):
                pass
            if not proc.is_alive() and proc.exitcode not in (0, None):
                reasons.append(f"rank {rank} died (exit code {proc.exitcode})")
        self.shutdown()
        return EngineDeadError("engine stopped: " + ("; ".join(reasons) if reasons else fallback))

    def shutdown(self) -> None:
        if not self.procs:
            return
        self._dead = True
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.procs, self.conns = [], []
