"""Helpers for engine tests: deterministic prompts and tandem's own logits for a token sequence.
Scope: used by the parity tests against Hugging Face; nothing here is an oracle itself."""

from __future__ import annotations

import random

import torch

from tandem import LLM, SamplingParams
from tandem.attention.forward_context import forward_context
from tandem.step_plan import RowSampling, ScheduledRow, StepPlan
from tandem.worker.input_batch import prepare_inputs

GREEDY = RowSampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, num_logprobs=None)


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0, low: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab_size) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def tandem_last_logits(llm: LLM, token_ids: list[int], chunk: int = 16) -> torch.Tensor:
    """Final-position logits [vocab] computed by the engine's model runner, prefilled in `chunk`-token
    steps through the paged cache (blocks 0.. of an idle engine with prefix caching off)."""
    runner = llm.engine.executor.runner
    assert not llm.engine.config.cache_config.enable_prefix_caching, "would overwrite cached blocks"
    block_size = runner.block_size
    blocks = list(range(-(-len(token_ids) // block_size)))
    hidden = None
    for start in range(0, len(token_ids), chunk):
        part = token_ids[start:start + chunk]
        last = start + len(part) == len(token_ids)
        plan = StepPlan([ScheduledRow("probe", part, start, blocks, True, GREEDY if last else None)])
        local = runner.pcp.maybe_partition(prepare_inputs(plan, block_size, runner.device))
        with forward_context(local.attn_metadata, runner.backends):
            hidden = runner.model(local.input_ids, local.positions)
    assert hidden is not None
    return runner.model.compute_logits(hidden[-1:])[0]


def metric(llm: LLM, name: str) -> float:
    return {m.name: m for m in llm.get_metrics()}[name].value  # type: ignore[union-attr]


def record_steps(llm: LLM, monkeypatch) -> list[tuple]:
    """Wrap the engine's executor so every (StepPlan, StepOutput) it runs is appended to the returned list."""
    steps: list[tuple] = []
    execute = llm.engine.executor.execute

    def recording_execute(plan):
        out = execute(plan)
        steps.append((plan, out))
        return out

    monkeypatch.setattr(llm.engine.executor, "execute", recording_execute)
    return steps


def spec_params(sampling: str, n: int, max_tokens: int = 12) -> list[SamplingParams]:
    """n requests' parameters: all greedy, or sampled (temperature 0.9, top-p 0.95) with seeds 100 + i."""
    if sampling == "greedy":
        return [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)] * n
    return [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=max_tokens, ignore_eos=True)
            for i in range(n)]


def run_tokens(path, prompts: list[list[int]], params: list[SamplingParams],
               **engine_kwargs) -> tuple[list[list[int]], str | None, dict]:
    """One engine over the prompt token ids, then shut down -> (output tokens, draft mode, metric values)."""
    llm = LLM(str(path), **engine_kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        return [o.outputs[0].token_ids for o in outs], llm.draft_mode, metrics
    finally:
        llm.shutdown()


def assert_drafts_keep_greedy_under_grammars(path, prompts: list[list[int]], schemas: list[dict], backend: str,
                                             speculative_config: dict, max_tokens: int = 200, **engine_kwargs) -> None:
    """Greedy under a JSON-schema grammar with `speculative_config` drafting gives the tokens of greedy without
    drafts (each draft row verified under the mask after the drafts before it), drafts were made, and every output
    that finished inside max_tokens follows its schema."""
    import json

    import jsonschema

    from tandem import StructuredOutputsParams

    params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=s))
              for s in schemas]
    engine = {**engine_kwargs, "structured_outputs_config": {"backend": backend, "disable_any_whitespace": True}}
    want, _, _ = run_tokens(path, prompts, params, **engine)
    llm = LLM(str(path), speculative_config=speculative_config, **engine)
    try:
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                   use_tqdm=False)]
        drafted = metric(llm, "tandem:spec_decode_num_draft_tokens")
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == want, f"{speculative_config['method']} drafts changed greedy tokens"
    assert drafted > 0
    for out, schema in zip(outs, schemas, strict=True):
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text, strict=False), schema)
