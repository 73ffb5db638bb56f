"""Issue 12 row 3: a hung rank (SIGSTOPped, so alive but silent) ends the engine within about twice the collective
timeout, with an error naming the rank, and leaves no process behind: `tandem serve -pcp 2` (open streams get an
error event, the server exits 1) and offline `LLM.generate` (EngineDeadError). With every rank stopped no
collective can time out, and the step watchdog ends the engine instead."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from server_utils import alive, descendants, rank_pids, serve_subprocess

from tandem import LLM, SamplingParams
from tandem.assets import default_model
from tandem.executor.multiproc import EngineDeadError

TIMEOUT_S = 4  # TANDEM_COLLECTIVE_TIMEOUT_S for these tests
# detection takes one collective timeout; reaping and the server's exit take a few seconds more on 2 busy cores
BOUND_S = 2 * TIMEOUT_S + 6


def _exists(pid: int) -> bool:
    """Any process entry, a zombie's included: a killed rank its parent never waited for stays one (this machine's
    init does not reap orphans)."""
    return Path(f"/proc/{pid}").exists()


def _assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while any(_exists(p) for p in pids):
        assert time.monotonic() < deadline, f"left behind (zombies included): {[p for p in pids if _exists(p)]}"
        time.sleep(0.1)


def test_a_stopped_rank_ends_the_server_naming_it(monkeypatch):
    monkeypatch.setenv("TANDEM_COLLECTIVE_TIMEOUT_S", str(TIMEOUT_S))
    proc, url = serve_subprocess(default_model(), "-pcp", "2", "--max-model-len", "1024")
    pids = descendants(proc.pid)
    try:
        body = json.dumps({"prompt": "hello", "max_tokens": 900, "ignore_eos": True, "stream": True}).encode()
        streams = [urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=body, headers={
            "Content-Type": "application/json"}), timeout=120) for _ in range(2)]
        for resp in streams:
            assert resp.readline().startswith(b"data: ")  # tokens are flowing
        victim = rank_pids(proc.pid)[1]
        os.kill(victim, signal.SIGSTOP)
        start = time.monotonic()
        for resp in streams:
            events = [line.decode() for line in resp if line.startswith(b"data: ")]
            errors = [json.loads(e[6:])["error"]["message"] for e in events if '"error"' in e]
            assert errors and "rank 1 is not responding (its process is stopped)" in errors[0], events[-2:]
            assert "Traceback" not in errors[0] and "File " not in errors[0], errors[0]
        assert proc.wait(timeout=BOUND_S) == 1
        elapsed = time.monotonic() - start
        assert elapsed < BOUND_S, f"the server took {elapsed:.1f} s to exit"
        stderr = proc.stderr.read().decode() if proc.stderr else ""
        assert "rank 1 is not responding" in stderr, stderr[-2000:]
        _assert_gone(pids)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _generate_while(llm: LLM, stop_ranks: list[int]) -> tuple[BaseException | None, float]:
    """Run a long generate on a thread; once it is under way, SIGSTOP the given ranks. Returns what it raised and
    the seconds from the stop to the raise; a generate still hanging after the bound fails the test."""
    pids = [p.pid for p in llm.engine.executor.procs]
    result: dict[str, object] = {}

    def run() -> None:
        try:
            llm.generate(["hello"] * 4, SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0),
                         use_tqdm=False)
        except BaseException as e:  # noqa: BLE001  handed to the test thread
            result["error"], result["at"] = e, time.monotonic()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    time.sleep(1.5)
    for rank in stop_ranks:
        os.kill(pids[rank], signal.SIGSTOP)
    stopped_at = time.monotonic()
    worker.join(BOUND_S + 10)
    assert not worker.is_alive(), f"generate still hangs {BOUND_S + 10} s after rank(s) {stop_ranks} stopped"
    error = result.get("error")
    assert error is None or isinstance(error, EngineDeadError), repr(error)
    return error, float(result.get("at", stopped_at)) - stopped_at  # type: ignore[arg-type]


@pytest.mark.parametrize("stop_ranks,named", [
    ([1], "rank 1 is not responding (its process is stopped)"),
    # nobody is left to time out a collective: the watchdog on rank 0's answer ends the step
    ([0, 1], "rank 0 did not answer within"),
])
def test_offline_generate_with_a_stopped_rank_raises_naming_it(monkeypatch, stop_ranks, named):
    monkeypatch.setenv("TANDEM_COLLECTIVE_TIMEOUT_S", str(TIMEOUT_S))
    llm = LLM(default_model(), prefill_context_parallel_size=2, max_model_len=1024)
    pids = [p.pid for p in llm.engine.executor.procs]
    try:
        error, elapsed = _generate_while(llm, stop_ranks)
        assert error is not None, "generate finished although a rank was stopped"
        assert named in str(error) and "Traceback" not in str(error), str(error)
        assert elapsed < BOUND_S, f"{elapsed:.1f} s from the stop to the error"
        _assert_gone(pids)
        with pytest.raises(EngineDeadError, match="create a new LLM"):
            llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
