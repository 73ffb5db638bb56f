"""Hugging Face's own OpenAI-compatible server (`transformers serve`) as the peer of `tandem bench serve --vs hf`:
the model folder to give it, whether its continuous batching fits the checkpoint, and its life (start on a free
loopback port, wait for /health, stop on the way out, errors included)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class PeerError(RuntimeError):
    pass


@dataclass(frozen=True)
class HFPeerConfig:
    model: str | None = None  # the model folder; None: the root the --url server reports
    dtype: str = "auto"
    continuous_batching: str = "auto"  # auto (on unless the checkpoint is MLA), on or off
    startup_timeout_s: float = 300.0


def served_model_root(url: str) -> str:
    """The model folder of the server at `url`: the `root` of the first entry of its GET /v1/models."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as resp:
            models = json.loads(resp.read())["data"]
    except (OSError, ValueError, KeyError) as e:
        raise PeerError(f"--url {url}: GET /v1/models failed ({e}); pass --hf-model PATH") from e
    root = models[0].get("root") if models else None
    if not root:
        raise PeerError(f"--url {url}: /v1/models names no model folder ('root'); pass --hf-model PATH")
    return root


def is_mla(model: str) -> bool:
    config = json.loads((Path(model) / "config.json").read_text())
    return "kv_lora_rank" in config


def use_continuous_batching(model: str, choice: str) -> bool:
    # transformers' paged cache fails on MLA checkpoints on CPU (index_copy_ shape mismatch in its cache
    # update), so `auto` keeps continuous batching for the GQA/MHA ones, where it works.
    return choice == "on" or (choice == "auto" and not is_mla(model))


def peer_name(continuous_batching: bool) -> str:
    return f"hf (transformers serve, {'continuous batching' if continuous_batching else 'no continuous batching'})"


def free_port() -> int:
    """A loopback port free now and outside the kernel's ephemeral range: a port from bind(0) is ephemeral, and an
    outgoing connection (a gloo rank's, another server's client) can take it before the server binds it."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        if low <= port <= high:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise PeerError("no free loopback port below the ephemeral range")


def _log_tail(path: Path, num_lines: int = 20) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-num_lines:])


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerError(f"transformers serve exited with status {proc.returncode} before it was up; the end of "
                            f"its log:\n{_log_tail(log)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise PeerError(f"transformers serve did not answer {url}/health within {timeout_s:.0f} s (--hf-startup-timeout); "
                    f"the end of its log:\n{_log_tail(log)}")


# transformers' paged cache holds tokens in blocks of this many (ContinuousBatchingConfig's default page_size)
HF_CB_PAGE_SIZE = 256


def cb_num_blocks(prompts: list[str], concurrency: int, max_tokens: int) -> int:
    """A continuous-batching cache for the load: `concurrency` of the longest requests at once, twice over. Left to
    itself, transformers sizes its cache to 90% of the free memory, and on a CPU it fills the attention mask that
    size implies at start-up: on a 24 GiB, 2-core machine `transformers serve` took 78 s to answer /health for a
    tiny model (and held ~20 GiB beside the server under test). A prompt's tokens are counted as its UTF-8 bytes
    (a byte-level BPE token is at least one byte), plus 256 for a chat template."""
    longest = max((len(p.encode()) for p in prompts), default=0) + 256 + max_tokens
    return 2 * -(-max(1, concurrency) * longest // HF_CB_PAGE_SIZE)


@contextlib.contextmanager
def hf_server(model: str, dtype: str, continuous_batching: bool, startup_timeout_s: float,
              num_blocks: int | None = None) -> Iterator[str]:
    """`transformers serve MODEL` on CPU from this venv; yields its base URL and stops it on exit. num_blocks: its
    continuous-batching cache (cb_num_blocks), or None for transformers' own sizing."""
    exe = Path(sys.executable).parent / "transformers"
    if not exe.is_file():
        raise PeerError(f"{exe} not found: install transformers' serving extras (pip install 'tandem[bench]')")
    if not (Path(model) / "config.json").is_file():
        raise PeerError(f"model folder {model!r} has no config.json (is --hf-model, or the server's root, a path "
                        "readable from here?)")
    port = free_port()
    cmd = [str(exe), "serve", model, "--device", "cpu", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port)]
    if continuous_batching:
        cmd.append("--continuous-batching")
        if num_blocks is not None:
            cmd += ["--cb-num-blocks", str(num_blocks)]
    # Offline: the model is a local folder, and nothing may be fetched at run time.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-hf-") as tmp:
        log = Path(tmp) / "transformers-serve.log"
        with log.open("wb") as log_file:
            # Its own session: Ctrl-C reaches only this process, which then stops the server in `finally`.
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        print(f"started {' '.join(cmd)} (pid {proc.pid})", file=sys.stderr)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, proc, log, startup_timeout_s)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
