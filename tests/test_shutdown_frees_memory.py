"""A shut-down engine holds no weights and no KV pool, whoever still holds the engine object: a served app's routes
stay cached by the web framework for the life of the process (fastapi keys a module-level cache on each endpoint,
whose closure holds the engine), and a test process that served a few models once ran out of memory."""

from __future__ import annotations

import gc
import os
import sys
import weakref

import pytest
from server_utils import server_in_thread

from tandem import LLM, SamplingParams
from tandem.entrypoints.engine_args import EngineArgs


def test_a_served_engine_frees_its_model_runner_at_shutdown(tiny_checkpoints):
    path = tiny_checkpoints("llama")
    with server_in_thread(EngineArgs(model=str(path), dtype="float32"), "tiny") as (_url, engine):
        runner = weakref.ref(engine.engine.executor.runner)
        model = weakref.ref(engine.engine.executor.runner.model)
    gc.collect()
    assert runner() is None and model() is None, "the model runner outlived shutdown"
    assert engine is not None  # the engine object itself is still held here, and holds nothing heavy


def test_a_shut_down_llm_frees_its_runner_and_refuses_new_steps(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints("qwen3")), dtype="float32")
    runner = weakref.ref(llm.engine.executor.runner)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()
    gc.collect()
    assert runner() is None
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)


def test_an_engine_refused_after_its_ranks_started_leaves_no_rank_behind(tiny_checkpoints):
    """The KV capacity check runs once the ranks have sized their pools: a refusal there shuts them down."""
    import multiprocessing

    from tandem.config import ConfigError

    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ConfigError, match="fewer than max_model_len"):
        LLM(str(tiny_checkpoints("llama")), dtype="float32", prefill_context_parallel_size=2,
            num_gpu_blocks_override=2, max_model_len=128)
    left = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert not left, f"ranks left running: {left}"


_KEPT_HEAP = """
import random
from tandem import LLM, SamplingParams
from tandem.assets import default_model

def rss_mib():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024

def serve_once(prompt_len):
    llm = LLM(default_model(), dtype="float32", max_num_batched_tokens=2048, enable_prefix_caching=False)
    random.seed(0)
    llm.generate([{"prompt_token_ids": [random.randrange(3, 2000) for _ in range(prompt_len)]}],
                 SamplingParams(max_tokens=1), use_tqdm=False)
    used = rss_mib()
    llm.shutdown()
    return used

serve_once(16)  # loads every module and library an engine uses: they stay, and are not what is measured
before = rss_mib()
used = serve_once(2000)
print(before, used, rss_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and glibc's heap")
def test_a_shut_down_engine_hands_its_kept_activations_back():
    """The steps keep freed activation pages in the process (worker/host_memory.py); shutdown hands them back to the
    kernel, with the weights. Kept, they slowed whatever the process did next (a PCP=2 engine's ranks after a PCP=1
    engine: 3.9 s of page-fault time instead of 0.3 s, its prefill ~2x slower). Measured from a process that has
    already run and shut down a small engine, so modules loaded on first use do not count: on the EPYC here the
    process ends 5 MiB above that with the release and 56-65 MiB above it without."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _KEPT_HEAP], capture_output=True, text=True, timeout=300, check=True,
                         env={**os.environ, "TANDEM_NATIVE_KERNELS": "0"})
    before, used, after = map(float, out.stdout.split()[-3:])
    assert used - before > 500, f"the prefill should have grown the process: {before:.0f} -> {used:.0f} MiB"
    assert after - before < 25, \
        f"RSS {before:.0f} MiB before the engine, {used:.0f} after a prefill, still {after:.0f} after shutdown"
