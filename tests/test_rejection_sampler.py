"""Speculative-decoding verification: the batched rejection sampler equals the plain reference, follows the greedy
rule, reproduces `sample()` with no drafts, and is lossless (emitted tokens are distributed as the target alone)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tandem.engine.spec_policy import SpecPolicy
from tandem.layers.sampler import SamplingMetadata, keyed_uniform, processed_probs, sample
from tandem.spec_decode.reference_verify import verify_one
from tandem.spec_decode.rejection_sampler import ACCEPT_STREAM, DRAFT_STREAM, rejection_sample
from tandem.step_plan import RowSampling, ScheduledRow, StepOutput, StepPlan


def _meta(temperature, top_k, top_p, min_p, seeds, positions) -> SamplingMetadata:
    temperature = torch.as_tensor(temperature, dtype=torch.float32)
    return SamplingMetadata(
        temperature=temperature, top_k=torch.as_tensor(top_k, dtype=torch.int64),
        top_p=torch.as_tensor(top_p, dtype=torch.float32), min_p=torch.as_tensor(min_p, dtype=torch.float32),
        seeds=torch.as_tensor(seeds, dtype=torch.int64), positions=torch.as_tensor(positions, dtype=torch.int64),
        max_num_logprobs=None, all_greedy=bool((temperature == 0).all()))


def _row(meta: SamplingMetadata, i: int, num_rows: int) -> SamplingMetadata:
    """Request i's parameters repeated over its rows, positions counting up from its first sampled token."""
    def pick(t: torch.Tensor) -> torch.Tensor:
        return t[i:i + 1].expand(num_rows)

    return _meta(pick(meta.temperature), pick(meta.top_k), pick(meta.top_p), pick(meta.min_p), pick(meta.seeds),
                 meta.positions[i] + torch.arange(num_rows))


def _reference(target_logits, draft_token_ids, draft_probs, num_draft_tokens, meta) -> list[list[int]]:
    """Loop over requests calling `verify_one` with the keyed uniforms and the keyed exponential race."""
    out, row, draft = [], 0, 0
    for i, k in enumerate(num_draft_tokens):
        req_meta = _row(meta, i, k + 1)
        seed, pos = req_meta.seeds[:1], int(meta.positions[i])
        logits = target_logits[row:row + k + 1]  # [K+1, V]
        greedy = float(meta.temperature[i]) == 0
        probs = logits.double().softmax(-1) if greedy else processed_probs(logits, req_meta).double()
        uniforms = keyed_uniform(seed.expand(k), pos + torch.arange(k), 1, stream=ACCEPT_STREAM)[:, 0]

        def race(p: torch.Tensor, j: int, seed=seed, pos=pos) -> int:
            noise = -torch.log(keyed_uniform(seed, torch.tensor([pos + j]), p.shape[-1]))[0]
            return int((p / noise).argmax())

        q = draft_probs[draft:draft + k].double() if draft_probs is not None else None
        out.append(verify_one(probs, draft_token_ids[draft:draft + k].tolist(), q, greedy, uniforms, race))
        row, draft = row + k + 1, draft + k
    return out


@pytest.mark.parametrize("one_hot_drafts", [False, True])
def test_batched_matches_reference_on_random_batches(one_hot_drafts):
    gen = torch.Generator().manual_seed(7)
    num_accepted_total = num_rejected_total = 0
    for case in range(40):
        num_reqs = int(torch.randint(1, 7, (1,), generator=gen))
        vocab = [5, 17, 64][case % 3]
        k = torch.randint(0, 5, (num_reqs,), generator=gen).tolist()
        rnd = torch.rand(num_reqs, 5, generator=gen)
        meta = _meta(
            temperature=torch.where(rnd[:, 0] < 0.3, 0.0, 0.5 + rnd[:, 1]),
            top_k=torch.where(rnd[:, 2] < 0.5, 0, torch.randint(1, vocab + 3, (num_reqs,), generator=gen)),
            top_p=torch.where(rnd[:, 3] < 0.5, 1.0, 0.6 + 0.35 * rnd[:, 3]),
            min_p=torch.where(rnd[:, 4] < 0.7, 0.0, 0.05),
            seeds=torch.randint(0, 2**40, (num_reqs,), generator=gen),
            positions=torch.randint(0, 10**6, (num_reqs,), generator=gen))
        target_logits = 2 * torch.randn(sum(k) + num_reqs, vocab, generator=gen)  # [T, V]
        req_of_row = torch.arange(num_reqs).repeat_interleave(torch.tensor(k) + 1)
        row_is_draft = torch.cat([torch.arange(n + 1) < n for n in k])  # [T], False on each bonus row
        # drafters that partly agree with the target, so both acceptance and rejection occur
        draft_logits = target_logits[row_is_draft] + 1.5 * torch.randn(sum(k), vocab, generator=gen)  # [D, V]
        draft_probs = None if one_hot_drafts else draft_logits.softmax(-1)
        draft_token_ids = (draft_logits.argmax(-1) if one_hot_drafts
                           else torch.multinomial(draft_probs, 1, generator=gen)[:, 0])  # [D]

        emitted, counts = rejection_sample(target_logits, draft_token_ids, draft_probs, k, meta)
        expected = _reference(target_logits, draft_token_ids, draft_probs, k, meta)
        for i in range(num_reqs):
            assert emitted[i] == expected[i], (
                f"case {case} request {i} (K={k[i]}, temp={float(meta.temperature[i]):.2f}, top_k="
                f"{int(meta.top_k[i])}, top_p={float(meta.top_p[i]):.2f}): batched {emitted[i]} != "
                f"reference {expected[i]}; drafts {draft_token_ids[req_of_row[row_is_draft] == i].tolist()}")
            assert counts[i] == len(emitted[i]) - 1
        num_accepted_total += sum(counts)
        num_rejected_total += sum(n < ki for n, ki in zip(counts, k, strict=True))
    assert num_accepted_total > 20 and num_rejected_total > 20, (
        f"random cases exercised too little: {num_accepted_total} accepted, {num_rejected_total} rejections")


@pytest.mark.parametrize("all_greedy", [True, False])
def test_greedy_accepts_matching_prefix_then_emits_target_argmax(all_greedy):
    torch.manual_seed(0)
    vocab, k = 32, [3, 3, 0, 2]
    target_logits = torch.randn(sum(k) + len(k), vocab)  # [T, V]
    argmax = target_logits.argmax(-1).tolist()
    wrong = [(t + 1) % vocab for t in argmax]
    # request 0: all three drafts match; request 1: mismatch at its second draft; request 3: mismatch at once
    draft_token_ids = torch.tensor([argmax[0], argmax[1], argmax[2], argmax[4], wrong[5], argmax[6],
                                    wrong[9], argmax[10]])
    temperature = [0.0, 0.0, 0.0, 0.0] if all_greedy else [0.0, 0.0, 0.0, 1.0]
    meta = _meta(temperature, [0] * 4, [1.0] * 4, [0.0] * 4, [1, 2, 3, 4], [100, 200, 300, 400])
    draft_probs = torch.full((sum(k), vocab), 1.0 / vocab)  # greedy requests must ignore the draft distribution
    emitted, counts = rejection_sample(target_logits, draft_token_ids, draft_probs, k, meta)
    assert emitted[0] == [argmax[0], argmax[1], argmax[2], argmax[3]], f"all accepted plus bonus: {emitted[0]}"
    assert emitted[1] == [argmax[4], argmax[5]], f"first mismatch must emit the target argmax and stop: {emitted[1]}"
    assert emitted[2] == [argmax[8]], f"K=0 must emit the argmax: {emitted[2]}"
    assert counts[:3] == [3, 1, 0], f"accepted counts {counts[:3]}"
    if all_greedy:
        assert emitted[3] == [argmax[9]] and counts[3] == 0, f"mismatch at the first draft: {emitted[3]}"


def test_no_drafts_reproduces_sample_exactly():
    gen = torch.Generator().manual_seed(3)
    num_reqs, vocab = 64, 50
    logits = 3 * torch.randn(num_reqs, vocab, generator=gen)  # [R, V]
    rnd = torch.rand(num_reqs, generator=gen)
    meta = _meta(torch.where(rnd < 0.25, 0.0, 0.3 + rnd), torch.where(rnd < 0.5, 0, 7),
                 torch.where(rnd > 0.6, 0.8, 1.0), torch.where(rnd > 0.9, 0.1, 0.0),
                 torch.randint(0, 2**40, (num_reqs,), generator=gen),
                 torch.randint(0, 10**6, (num_reqs,), generator=gen))
    emitted, counts = rejection_sample(logits, torch.zeros(0, dtype=torch.int64), None, [0] * num_reqs, meta)
    expected = sample(logits, meta).tolist()
    mismatched = [i for i in range(num_reqs) if emitted[i] != [expected[i]]]
    assert not mismatched, f"K=0 differs from sample() at rows {mismatched}: {[emitted[i] for i in mismatched]}"
    assert counts == [0] * num_reqs


def test_keyed_uniform_stream_zero_is_unchanged_and_streams_are_independent():
    seeds, positions = torch.tensor([42]), torch.tensor([5])
    # values recorded before `stream` existed: adding streams must not move any existing sampled token
    recorded = [0.7093986858462122, 0.6578163344836905, 0.3447152230933727]
    assert keyed_uniform(seeds, positions, 3).tolist() == [recorded]
    assert keyed_uniform(seeds, positions, 3, stream=0).tolist() == [recorded]
    many = keyed_uniform(torch.arange(20000), torch.arange(20000), 1, stream=ACCEPT_STREAM)[:, 0]
    base = keyed_uniform(torch.arange(20000), torch.arange(20000), 1)[:, 0]
    corr = float(np.corrcoef(many.numpy(), base.numpy())[0, 1])
    assert abs(corr) < 0.03, f"stream 1 correlates with stream 0: {corr:.3f}"


VOCAB, NUM_SAMPLES = 8, 20000
L0 = torch.tensor([1.2, 0.9, 0.6, 0.3, 0.0, -0.2, -0.5, -0.8])  # [V] target logits at the first position
# [V, V] target logits at the second position, given draft 1 (a real target conditions on it)
L1 = 0.8 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(11))


def _drafter(kind: str, target0: torch.Tensor, target1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft distributions q0 [V] and q1 [V, V] (given draft 1) for processed targets p0 [V] and p1 [V, V]."""
    gen = torch.Generator().manual_seed(13)
    if kind == "good":
        q0, q1 = [(t.log() + 0.1 * torch.randn(t.shape, generator=gen)).softmax(-1) for t in (target0, target1)]
    elif kind == "reduced":  # an EAGLE-3 head's q: softmax over a draft vocabulary, zero on the other ids
        draft_vocab = torch.tensor([0, 2, 3, 6])
        q0, q1 = [torch.zeros_like(t).index_copy_(-1, draft_vocab, (t.log() + 0.3 * torch.randn(
            t.shape, generator=gen)).index_select(-1, draft_vocab).softmax(-1)) for t in (target0, target1)]
    elif kind == "disjoint":
        q0, q1 = [(t == 0).double() / (t == 0).sum(-1, keepdim=True) for t in (target0, target1)]
    else:  # "bad": most mass where the target has least, some outside its support
        q0, q1 = [t.amax(-1, keepdim=True) + 0.02 - t for t in (target0, target1)]
        q0, q1 = q0 / q0.sum(-1, keepdim=True), q1 / q1.sum(-1, keepdim=True)
    return q0, q1


def _race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    return (probs / -torch.log(keyed_uniform(seeds, positions, probs.shape[-1], stream))).argmax(-1)


@pytest.mark.parametrize("drafter,temperature,top_k,k_policy", [
    ("good", 1.0, 0, "fixed"), ("bad", 1.0, 0, "fixed"), ("disjoint", 1.0, 4, "fixed"),
    ("greedy_one_hot", 1.0, 0, "fixed"), ("bad", 0.7, 5, "fixed"),
    ("good", 1.0, 0, "auto"), ("bad", 0.7, 5, "auto"), ("greedy_one_hot", 1.0, 0, "auto"),
    ("reduced", 1.0, 0, "fixed"), ("reduced", 0.7, 5, "auto"),
])
def test_emitted_tokens_are_distributed_as_the_target(drafter, temperature, top_k, k_policy):
    """First token ~ p0; the pair (first, second) ~ p0(y1) p1(y2 | y1), where the second comes from the same
    step when draft 1 was accepted and otherwise from the next step (K = 0 at the following position).
    "auto": each step's K in {0, 1, 2} is picked by the cost-model policy from the steps before it."""
    first, second, p0, p1, num_accepted, num_single = _first_two_tokens(drafter, temperature, top_k, DRAFT_STREAM,
                                                                        k_policy)
    n = NUM_SAMPLES
    if drafter == "disjoint":
        assert num_accepted == 0, f"drafts outside the target's support were accepted {num_accepted} times"
    else:
        assert 0 < num_single < n, f"{drafter}: rejection path not exercised ({num_accepted} accepted)"
    _assert_matches("first token", np.bincount(first.numpy(), minlength=VOCAB), p0.numpy() * n)
    joint = (p0[:, None] * p1).numpy().reshape(-1) * n  # [V*V]
    _assert_matches("(first, second) pair", np.bincount((first * VOCAB + second).numpy(), minlength=VOCAB**2), joint)


def test_drafts_raced_on_the_verification_stream_break_losslessness():
    """Why DRAFT_STREAM exists: a draft sampled with the keys of its own recovery skews the output."""
    first, _, p0, _, _, _ = _first_two_tokens("bad", 1.0, 0, draft_stream=0)
    counts = np.bincount(first.numpy(), minlength=VOCAB)
    _, pvalue = chisquare(counts, p0.numpy() / p0.numpy().sum() * NUM_SAMPLES)
    assert pvalue < 1e-6, f"shared keys unexpectedly looked lossless (p={pvalue:.2e}); has the keying changed?"


def _first_two_tokens(drafter: str, temperature: float, top_k: int, draft_stream: int, k_policy: str = "fixed"):
    """Runs NUM_SAMPLES requests with K = 2 (or K from the "auto" policy; varied seeds and positions) and returns
    the first two output tokens [n], [n], the processed targets p0 [V] and p1 [V, V], the accepted draft count
    and the one-token steps."""
    n = NUM_SAMPLES
    gen = torch.Generator().manual_seed(5)
    seeds = torch.randint(0, 2**40, (n,), generator=gen)
    positions = torch.randint(0, 10**6, (n,), generator=gen)
    meta = _meta([temperature] * n, [top_k] * n, [1.0] * n, [0.0] * n, seeds, positions)
    p0 = processed_probs(L0[None], _row(meta, 0, 1))[0].double()  # [V]
    p1 = processed_probs(L1, _row(meta, 0, VOCAB)).double()  # [V, V]; parameters are per request, not position
    if drafter == "greedy_one_hot":
        # a greedy drafter whose argmax varies with (unmodelled) context: q is one-hot on whatever it picked
        x1 = (L0 + torch.randn(n, VOCAB, generator=gen)).argmax(-1)  # [n]
        x2 = (L1[x1] + torch.randn(n, VOCAB, generator=gen)).argmax(-1)
        draft_probs = None
    else:
        q0, q1 = _drafter(drafter, p0, p1)
        x1 = _race(q0.expand(n, VOCAB), seeds, positions, draft_stream)
        x2 = _race(q1[x1], seeds, positions + 1, draft_stream)
        draft_probs = torch.stack([q0.expand(n, VOCAB), q1[x1]], dim=1).reshape(2 * n, VOCAB)  # [2n, V]
    target_logits = torch.stack([L0.expand(n, VOCAB), L1[x1], L1[x2]], dim=1).reshape(3 * n, VOCAB)  # [3n, V]
    if k_policy == "auto":
        emitted, counts = _verify_with_auto_k(target_logits, torch.stack([x1, x2], 1), draft_probs, meta)
    else:
        emitted, counts = rejection_sample(target_logits, torch.stack([x1, x2], 1).reshape(-1), draft_probs,
                                           [2] * n, meta)

    first = torch.tensor([e[0] for e in emitted])
    need_next = torch.tensor([len(e) == 1 for e in emitted])
    m = int(need_next.sum())  # one-token steps; the engine's next step samples the second token with K = 0
    follow_meta = _meta([temperature] * m, [top_k] * m, [1.0] * m, [0.0] * m, seeds[need_next],
                        positions[need_next] + 1)
    follow, _ = rejection_sample(L1[first[need_next]], torch.zeros(0, dtype=torch.int64), None, [0] * m, follow_meta)
    follow_iter = iter(follow)
    second = torch.tensor([e[1] if len(e) > 1 else next(follow_iter)[0] for e in emitted])
    return first, second, p0, p1, sum(counts), m


STEP_ROWS = 500
_GREEDY = RowSampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, num_logprobs=None)


def _verify_with_auto_k(target_logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                        meta: SamplingMetadata) -> tuple[list[list[int]], list[int]]:
    """The n requests verified in steps of STEP_ROWS, each step at the K the policy picks from the acceptance of
    the steps before it (as the engine picks K before a step runs), with a synthetic cost of each step.
    target_logits [3n, V], drafts [n, 2], draft_probs [2n, V] or None."""
    n = drafts.shape[0]
    logits, q = target_logits.view(n, 3, VOCAB), None if draft_probs is None else draft_probs.view(n, 2, VOCAB)
    policy = SpecPolicy(2)
    policy.set_costs([STEP_ROWS], [[0.01 + 1e-5 * STEP_ROWS * (1 + k) + 0.002 * k for k in range(3)]])
    emitted, counts, ks = [], [], []
    for start in range(0, n, STEP_ROWS):
        idx = torch.arange(start, min(n, start + STEP_ROWS))
        k = policy.choose(len(idx))
        ks.append(k)
        sub = _meta(meta.temperature[idx], meta.top_k[idx], meta.top_p[idx], meta.min_p[idx], meta.seeds[idx],
                    meta.positions[idx])
        out, c = rejection_sample(logits[idx, :k + 1].reshape(-1, VOCAB), drafts[idx, :k].reshape(-1),
                                  None if q is None else q[idx, :k].reshape(-1, VOCAB), [k] * len(idx), sub)
        rows = [ScheduledRow(f"r{i}", [0] * (k + 1), 100, [], False, _GREEDY, num_draft_tokens=k) for i in idx]
        plan = StepPlan(rows, num_spec_tokens=k)
        policy.record_step(plan, StepOutput(out, [None] * len(out), [[0] * k] * len(out)),
                           0.01 + 1e-5 * plan.num_tokens + 0.002 * k)
        emitted += out
        counts += list(c)
    assert len(set(ks)) >= 2, f"the policy never changed K ({ks}): the test would not cover a varying K"
    return emitted, counts


def _assert_matches(what: str, counts: np.ndarray, expected: np.ndarray) -> None:
    zero = expected == 0
    assert counts[zero].sum() == 0, f"{what}: emitted tokens the target never samples: {np.nonzero(counts * zero)}"
    # cells expected below 5 are pooled so the chi-square approximation holds
    small = ~zero & (expected < 5)
    obs = np.append(counts[~zero & ~small], counts[small].sum())
    exp = np.append(expected[~zero & ~small], expected[small].sum())
    obs, exp = (obs, exp) if exp[-1] > 0 else (obs[:-1], exp[:-1])
    _, pvalue = chisquare(obs, exp * obs.sum() / exp.sum())
    assert pvalue > 1e-3, f"{what}: chi-square p={pvalue:.2e}; counts {obs} vs expected {exp.round(1)}"


def test_all_greedy_host_path_equals_the_tensor_path():
    """An all-greedy batch is matched on host lists (_greedy_prefix_match); the same batch flagged not all-greedy
    (every temperature still 0) runs the tensor index math: both must emit the same tokens, K_i = 0 included."""
    gen = torch.Generator().manual_seed(11)
    accepted = rejected = 0
    for _ in range(60):
        num_reqs = int(torch.randint(1, 9, (1,), generator=gen))
        k = torch.randint(0, 5, (num_reqs,), generator=gen).tolist()
        vocab = 6  # few tokens: drafts often equal the argmax
        target_logits = torch.randn(sum(k) + num_reqs, vocab, generator=gen)
        draft_token_ids = torch.randint(0, vocab, (sum(k),), generator=gen)
        args = ([0.0] * num_reqs, [0] * num_reqs, [1.0] * num_reqs, [0.0] * num_reqs, list(range(num_reqs)),
                [10 * i for i in range(num_reqs)])
        fast = rejection_sample(target_logits, draft_token_ids, None, k, _meta(*args))
        tensor_meta = dataclasses.replace(_meta(*args), all_greedy=False)
        assert fast == rejection_sample(target_logits, draft_token_ids, None, k, tensor_meta), (k, draft_token_ids)
        accepted += sum(fast[1])
        rejected += sum(n < ki for n, ki in zip(fast[1], k, strict=True))
    assert accepted > 30 and rejected > 30, (accepted, rejected)
