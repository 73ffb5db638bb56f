"""Seeds the "auto" K policy's cost models at start-up with a few synthetic steps through the real executor.

Before the first request, the engine runs greedy steps on random prompts in free KV blocks (nothing is cached
yet, so nothing can be hit later; the slots are overwritten by real requests): a few short rows (64 tokens) and,
where the KV pool, the step budget and max_model_len allow, one long row (up to LONG_CONTEXT tokens), prefilled,
then decode steps verifying and proposing each K = K_max .. 0 with all rows, with one short row and with the long
row alone, twice. Each step's rank-0 wall time and drafter time train the cost models exactly as a served step
does (acceptance of random prompts is not learned). Then the draft-prefill prediction of both PCP draft modes is
logged.

The long row is what tells a cost per row from a cost per key of context: at one context length the two are
collinear, and the fit may put a decode's cost on either. After a calibration at 64 tokens only, n-gram's
verification at 8 rows x ~1,000 keys was priced 179 ms against 17 ms measured (per verifying key 2e-5 s), and
~150 served steps passed before that was unlearnt.

Branch rows (up to 3, where max_num_seqs and the pool allow) start with the long row's whole prompt blocks, as
requests behind one cached prefix do, and decode with it as one more subset: their keys are read once (cascade
attention) but attended by every row's queries, which is what tells the cost of a key read (memory) from the cost
of a key attended (compute). One row alone cannot: a decode reads and attends each key once, and a verification's
extra attended keys cost too little at 1,024 keys to be seen through the noise. Without them the fit priced a
decode of 8 rows behind an ~8k shared prefix ~20% low.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.attention.metadata import CASCADE_MIN_KEYS
from tandem.config import EngineConfig
from tandem.engine.spec_cost_model import draft_prefill_terms_from_target, predict_draft_prefill_s
from tandem.engine.spec_policy import SpecPolicy
from tandem.step_plan import RowSampling, ScheduledRow, StepOutput, StepPlan

logger = logging.getLogger("tandem")
GREEDY = RowSampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, num_logprobs=None)
NUM_REPEATS = 2
LONG_CONTEXT = 1024  # the long calibration row's prompt (bounded by the step budget and max_model_len / 2)
MAX_BRANCHES = 3  # rows behind the long row's prompt blocks


@dataclass
class _Row:
    request_id: str
    block_ids: list[int]
    tokens: list[int]  # prompt + emitted; all but the last are computed after the prefill
    drafts: list[int] = field(default_factory=list)
    cached: int = 0  # leading prompt tokens already in (shared) blocks: the prefill starts after them


def calibrate(policy: SpecPolicy, execute: Callable[[StepPlan], StepOutput], config: EngineConfig,
              num_blocks: int) -> list[str]:
    """Run the synthetic steps; return their request ids, for the next real plan to free on every rank."""
    k_max, block_size = policy.max_k, config.cache_config.block_size
    max_len, max_seqs = config.model_config.max_model_len, config.scheduler_config.max_num_seqs
    budget = config.scheduler_config.max_num_batched_tokens
    # a row decodes in at most two subsets a repeat, each step growing it by at most K_max + 1 tokens; the drafter
    # writes K_max slots past it
    growth = 2 * NUM_REPEATS * (k_max + 1) ** 2 + config.speculative_config.num_lookahead_slots + 1
    num_short = min(4, max_seqs)
    prompt_len = min(64, budget // num_short, max_len // 4)
    long_len = min(LONG_CONTEXT, budget, max_len // 2 - growth)
    short_blocks, long_blocks = -(-(prompt_len + growth) // block_size), -(-(long_len + growth) // block_size)
    with_long = max_seqs > 1 and long_len >= 4 * prompt_len and short_blocks + long_blocks <= num_blocks
    if with_long:
        num_short = min(num_short, max_seqs - 1)
    num_short = min(num_short, (num_blocks - with_long * long_blocks) // short_blocks)
    # branches of the long row: its whole prompt blocks, then a short row's worth of their own
    # (where they share enough keys for the runner's cascade attention, and their prefill fits one step)
    shared = long_len // block_size  # whole blocks of the long prompt: its decodes never write them
    num_branches = 0 if not with_long or shared * block_size < CASCADE_MIN_KEYS else max(0, min(
        MAX_BRANCHES, max_seqs - 1 - num_short, budget // prompt_len,
        (num_blocks - long_blocks - num_short * short_blocks) // short_blocks))
    if num_short < 1 or prompt_len < 2 or prompt_len + growth > max_len:
        logger.info('num_speculative_tokens "auto": no room to calibrate; the first steps sweep K instead')
        return []
    rng = random.Random(0)
    vocab = int(config.model_config.get("vocab_size") or 2)
    lengths = [prompt_len] * num_short + ([long_len] if with_long else [])
    rows, first_block = [], 0
    for i, length in enumerate(lengths):
        n = -(-(length + growth) // block_size)
        rows.append(_Row(f"calibration-{i}", list(range(first_block, first_block + n)),
                         [rng.randrange(vocab) for _ in range(length)]))
        first_block += n
    short, long = rows[:num_short], rows[num_short:]
    branches = []
    if long and num_branches:
        for i in range(num_branches):
            n = -(-(prompt_len + growth) // block_size)
            branches.append(_Row(f"calibration-branch-{i}", long[0].block_ids[:shared]
                                 + list(range(first_block, first_block + n)),
                                 long[0].tokens[:shared * block_size] + [rng.randrange(vocab)
                                                                         for _ in range(prompt_len)],
                                 cached=shared * block_size))
            first_block += n
    _run(policy, execute, short, k_max, prefill=True)
    if long:
        _run(policy, execute, long, k_max, prefill=True)
    if branches:
        _run(policy, execute, branches, k_max, prefill=True)
    subsets = [rows, short[:1]] + ([long] if long else []) + ([long + branches] if branches else [])
    for _ in range(NUM_REPEATS):
        for subset in subsets:
            for k in range(k_max, -1, -1):
                _run(policy, execute, subset, k, prefill=False)
    _log_draft_prefill(policy, config)
    return [r.request_id for r in rows + branches]


def _run(policy: SpecPolicy, execute: Callable[[StepPlan], StepOutput], rows: list[_Row], k: int,
         prefill: bool) -> None:
    scheduled = []
    for r in rows:
        if prefill:
            scheduled.append(ScheduledRow(r.request_id, r.tokens[r.cached:], r.cached, r.block_ids, True, GREEDY))
        else:
            drafts = r.drafts[:k]
            scheduled.append(ScheduledRow(r.request_id, [r.tokens[-1], *drafts], len(r.tokens) - 1, r.block_ids,
                                          False, GREEDY, num_draft_tokens=len(drafts)))
    plan = StepPlan(scheduled, num_spec_tokens=k)
    start = time.perf_counter()
    output = execute(plan)
    policy.record_step(plan, output, time.perf_counter() - start, output.draft_s, calibration=True)
    for s, r in enumerate(rows):
        r.tokens += output.sampled_token_ids[s]
        r.drafts = output.draft_token_ids[s] if output.draft_token_ids else []


def _log_draft_prefill(policy: SpecPolicy, config: EngineConfig) -> None:
    spec, pcp = config.speculative_config, config.parallel_config.prefill_context_parallel_size
    if spec.method not in ("mtp", "dspark"):
        return
    policy.target.refit()
    num_tokens = config.scheduler_config.max_num_batched_tokens
    terms = draft_prefill_terms_from_target(policy.target, int(config.model_config.get("num_hidden_layers") or 1),
                                            pcp)
    predicted = predict_draft_prefill_s(terms, num_tokens)
    logger.info("draft prefill of a %d-token chunk at PCP=%d: sharded predicted %.1f ms vs replicated %.1f ms",
                num_tokens, pcp, 1e3 * predicted["sharded"], 1e3 * predicted["replicated"])
