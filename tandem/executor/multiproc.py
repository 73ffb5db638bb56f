"""Multi-rank executor: the engine process schedules; ranks 0..W-1 are worker processes forked
from a fork server that has torch and tandem imported.

Control plane: each StepPlan is pickled down a pipe to every rank, and rank 0 sends the StepOutput
back (all ranks sample identical tokens). Idle workers wait on their pipe, so there is no timeout
to trip between requests, and they exit when the engine process disappears (their `alive` pipe closes).
Data plane: tensors move over torch.distributed (gloo on CPU, NCCL on CUDA), whose collectives time out. A rank that
raises, dies or hangs ends the engine with EngineDeadError naming it, and every rank is reaped. Two lines of
defence against a hung (e.g. SIGSTOPped) rank: its peers' collectives time out and report, and rank 0's answer
to a step has a deadline (TANDEM_STEP_TIMEOUT_S, twice the collective timeout by default). The error is short
(it reaches HTTP clients); the ranks' tracebacks go to the log.

Rendezvous: the spawned ranks meet through a file store in a private temporary directory, not a TCP port. A port
picked free and released before rank 0 binds it can be taken in between (by another engine, or by any outgoing
connection drawing from the same ephemeral range), and the engine then fails to start with EADDRINUSE.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.distributed.init import (
    build_groups,
    collective_timeout_s,
    init_distributed,
    rank_device,
    step_timeout_s,
)
from tandem.runner.model_runner import ModelRunner
from tandem.step_plan import StepOutput, StepPlan

_POLL_S = 0.2
logger = logging.getLogger("tandem")


class EngineDeadError(RuntimeError):
    """A rank failed; the engine cannot continue."""


def _set_up_rank(config: EngineConfig, rank: int, init_method: str) -> ModelRunner:
    config = dataclasses.replace(config, device=rank_device(config.device, rank))  # ranks spawned here are local
    init_distributed(rank, config.parallel_config.world_size, init_method, config.device)
    runner = ModelRunner(config, build_groups(config.parallel_config, rank))
    # Every rank must agree on the pool size: take the smallest any rank can hold.
    num_blocks = torch.tensor([runner.num_kv_blocks()], device=config.device)
    dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN)
    runner.allocate_kv_cache(int(num_blocks))
    return runner


def _exit_with_engine(alive: Connection) -> None:
    """A rank must not outlive its engine, wherever it is blocked when the engine dies (building the native
    kernels, waiting on a build lock, inside a long step): a daemon thread that ends the process once the engine's
    end of the `alive` pipe closes, which the kernel does however the engine ends (SIGKILL included). The ranks are
    the fork server's children, not the engine's, so the parent pid says nothing. (Linux's PR_SET_PDEATHSIG would
    name the fork server too.)"""
    def watch() -> None:
        try:
            alive.recv()
        except (EOFError, OSError):
            pass
        os._exit(0)

    threading.Thread(target=watch, name="tandem-engine-watch", daemon=True).start()


def _name_process(name: str) -> None:
    """Set the process name `ps`, `top` and /proc/PID/comm show (Linux; 15 bytes): a forked rank would otherwise
    carry the fork server's command line."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _worker_main(config: EngineConfig, rank: int, init_method: str, conn: Connection, threads: int,
                 env: dict[str, str], cwd: str, alive: Connection) -> None:
    # the fork server started with the environment and directory of the engine that first needed it
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    _name_process(f"tandem-rank{rank}")
    torch.set_num_threads(threads)
    _exit_with_engine(alive)
    try:
        runner = _set_up_rank(config, rank, init_method)
        conn.send(("ready", runner.num_blocks))
        while True:
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
        self._rendezvous_dir = tempfile.mkdtemp(prefix="tandem-rendezvous-")
        init_method = f"file://{os.path.join(self._rendezvous_dir, 'store')}"
        threads = max(1, torch.get_num_threads() // world) if config.device == "cpu" else 1
        # Ranks fork from multiprocessing's fork server, which imports this module (torch, tandem) once per engine
        # process: a spawned rank re-imported them, ~3 s of CPU per rank per engine. The server itself is a clean
        # single-threaded process (never the engine's own state, threads or CUDA context), as spawn gives.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        alive_r, self._alive = ctx.Pipe(duplex=False)
        env = dict(os.environ)
        for rank in range(world):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(config, rank, init_method, child_conn, threads, env,
                                                          os.getcwd(), alive_r), name=f"tandem-rank{rank}", daemon=True)
            proc.start()
            child_conn.close()
            self.procs.append(proc)
            self.conns.append(parent_conn)
        alive_r.close()
        atexit.register(self.shutdown)
        self._dead = False
        # Loading weights can take a while; the start-up deadline is generous.
        # compiling the model's pieces at warmup (compilation_config.mode) takes minutes on a small CPU
        compile_s = 1800 if config.compilation_config.compiles else 0
        ready = [self._receive(rank, "ready", time.monotonic() + 60 + 4 * collective_timeout_s() + compile_s)
                 for rank in range(world)]
        self.num_kv_blocks = int(ready[0])

    def execute(self, plan: StepPlan) -> StepOutput:
        if self._dead:
            raise EngineDeadError("the engine stopped after a rank failure; create a new LLM")
        for rank, conn in enumerate(self.conns):
            self._checked(rank, lambda c=conn: c.send(plan))
        return self._receive(0, "output", time.monotonic() + step_timeout_s())

    def _receive(self, rank: int, expected: str, deadline: float | None) -> Any:
        """Wait for `expected` from `rank` while watching every rank for death or a reported error."""
        deadline_s = 0.0 if deadline is None else deadline - time.monotonic()
        while True:
            if self._checked(rank, lambda: self.conns[rank].poll(_POLL_S)):
                kind, payload = self._checked(rank, self.conns[rank].recv)
                if kind == expected:
                    return payload
                raise self._failure(f"rank {rank} sent {kind!r}", {rank: str(payload)})
            for other, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True)):
                # During steps only rank 0 answers, so anything on another pipe is an error report.
                reported = expected == "output" and other != rank and conn.poll(0)
                if not proc.is_alive() or reported:
                    raise self._failure(f"rank {other} stopped")
            if deadline is not None and time.monotonic() > deadline:
                raise self._failure(f"rank {rank} did not answer within {deadline_s:.0f} s", hung=True)

    def _checked(self, rank: int, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as e:
            raise self._failure(f"rank {rank} is gone ({type(e).__name__})") from e

    def _failure(self, fallback: str, errors: dict[int, str] | None = None, hung: bool = False) -> EngineDeadError:
        """Name the rank(s) that failed (a reported error, an exit code, a stopped or silent process), log their
        tracebacks, then reap every rank. `errors`: tracebacks already read off a pipe, by rank."""
        time.sleep(_POLL_S)  # let a crashing rank finish reporting
        errors = dict(errors or {})
        reported, reasons = set(), []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True)):
            try:
                if rank not in errors and conn.poll(0):
                    kind, detail = conn.recv()
                    if kind == "error":
                        errors[rank] = detail
            except (EOFError, OSError):
                pass
            if rank in errors:
                logger.error("rank %d raised:\n%s", rank, errors[rank])
                reasons.append(f"rank {rank} raised {_last_line(errors[rank])}")
                reported.add(rank)
                continue
            if not proc.is_alive() and proc.exitcode not in (0, None):
                reasons.append(f"rank {rank} died (exit code {proc.exitcode})")
                reported.add(rank)
        if hung and not reported:
            reasons.append(fallback)
        if reported or hung:
            # a peer that timed out waiting is the symptom; a live rank that reported nothing is the cause
            for rank, proc in enumerate(self.procs):
                if rank not in reported and proc.is_alive():
                    reasons.append(f"rank {rank} is not responding ({_process_state(proc.pid)})")
        self.shutdown(grace_s=1.0)
        return EngineDeadError("engine stopped: " + ("; ".join(reasons) if reasons else fallback))

    def shutdown(self, grace_s: float = 5.0) -> None:
        if not self.procs:
            return
        self._dead = True
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.procs, self.conns = [], []
        self._alive.close()
        shutil.rmtree(self._rendezvous_dir, ignore_errors=True)


def _last_line(text: str) -> str:
    """The exception line of a traceback: what a client may see (the frames, with their paths, go to the log)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "an error"


def _process_state(pid: int | None) -> str:
    """'its process is stopped' for a SIGSTOPped rank (state T), else 'hung'; read from /proc where there is one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "hung"
    return "its process is stopped" if state in ("T", "t") else "hung"
