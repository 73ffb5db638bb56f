"""RequestOutput.metrics (vLLM's request timings): arrival, first scheduled, first and last token and finish times
in order, the queue time and time to first token derived from them, the generated-token count; a parallel-sampling
parent's from its children's."""

from __future__ import annotations

from engine_utils import random_prompts

from tandem import LLM, SamplingParams
from tandem.engine.parallel_sampling import merged_metrics

ORDER = ("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time", "finished_time")


def test_each_output_carries_its_timings_in_order(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints("llama")), dtype="float32", max_num_seqs=2)
    prompts = random_prompts([9, 30, 14], vocab_size=500, seed=5)  # three requests, two at a time: one queues
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 3, 5)],
                        use_tqdm=False)
    for out in outs:
        m = out.metrics
        times = [m[name] for name in ORDER]
        assert times == sorted(times), m
        assert m["time_in_queue"] == m["first_scheduled_time"] - m["arrival_time"] >= 0
        assert m["time_to_first_token"] == m["first_token_time"] - m["arrival_time"] > 0
        assert m["num_generation_tokens"] == len(out.outputs[0].token_ids)
    parent = llm.generate([{"prompt_token_ids": prompts[0]}],
                          SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True),
                          use_tqdm=False)[0]
    assert parent.metrics["num_generation_tokens"] == 12
    assert [parent.metrics[name] for name in ORDER] == sorted(parent.metrics[name] for name in ORDER)


def test_parent_timings_span_the_children():
    a = {"arrival_time": 1.0, "first_token_time": 3.0, "finished_time": 5.0, "num_generation_tokens": 2.0}
    b = {"arrival_time": 1.5, "first_token_time": 2.5, "finished_time": 6.0, "num_generation_tokens": 3.0}
    assert merged_metrics(merged_metrics({}, a), b) == {"arrival_time": 1.0, "first_token_time": 2.5,
                                                         "finished_time": 6.0, "num_generation_tokens": 5.0}
