"""A shut-down engine holds no weights and no KV pool, whoever still holds the engine object: a served app's routes
stay cached by the web framework for the life of the process (fastapi keys a module-level cache on each endpoint,
whose closure holds the engine), and a test process that served a few models once ran out of memory."""

from __future__ import annotations

import gc
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
