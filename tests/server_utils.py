"""Starting `tandem serve` for tests: in this process (uvicorn in a thread, for speed) or as a subprocess (for
signals and dead ranks), on a free loopback port; and the process tree of a server (its ranks)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tandem.bench.hf_peer import free_port
from tandem.entrypoints.engine_args import EngineArgs
from tandem.entrypoints.openai.api_server import build_app
from tandem.entrypoints.openai.async_engine import AsyncEngine
from tandem.entrypoints.openai.limits import ServerLimits
from tandem.entrypoints.openai.tool_calls import ToolServing


def wait_healthy(url: str, proc: subprocess.Popen | None = None, tries: int = 600) -> None:
    for _ in range(tries):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(proc.stderr.read().decode()[-2000:] if proc.stderr else "server exited") from None
            time.sleep(0.1)
    raise AssertionError(f"{url}/health never answered")


@contextmanager
def server_in_thread(args: EngineArgs, name: str, limits: ServerLimits | None = None,
                     tool_serving: ToolServing | None = None) -> Iterator[tuple[str, AsyncEngine]]:
    import uvicorn

    engine = AsyncEngine(args)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(engine, name, str(args.model), limits,
                                                  tool_serving=tool_serving), host="127.0.0.1",
                                        port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        yield url, engine
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()


def serve_subprocess(model: str, *flags: str, tries: int = 3) -> tuple[subprocess.Popen, str]:
    """`tandem serve MODEL FLAGS` in its own process, up and healthy; the caller stops it. A port taken between
    choosing and binding it (by another test's server) is retried on a fresh port; any other failure is raised."""
    for attempt in range(tries):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "tandem.entrypoints.cli", "serve", model, "--dtype", "float32",
                                 "--port", str(port), *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
        except AssertionError as e:
            proc.kill()
            if "address already in use" in str(e) and attempt + 1 < tries:
                continue
            raise
        except BaseException:
            proc.kill()
            raise
        return proc, url
    raise AssertionError("unreachable")


def children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # fields[1] is the parent pid
            kids.append(int(stat.parent.name))
    return kids


def descendants(pid: int) -> list[int]:
    return [p for kid in children(pid) for p in [kid, *descendants(kid)]]


def rank_pids(pid: int) -> list[int]:
    """The ranks among `pid`'s descendants, in rank order (each names itself tandem-rankN), not multiprocessing's
    fork server or resource tracker."""
    named = {}
    for p in descendants(pid):
        try:
            comm = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("tandem-rank"):
            named[int(comm.removeprefix("tandem-rank"))] = p
    return [named[rank] for rank in sorted(named)]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
