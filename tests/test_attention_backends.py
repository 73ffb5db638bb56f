"""Attention backends: every backend of a kind gives the same greedy output at PCP size 1; the
capability flags steer selection (automatic picks PCP-capable ones, an explicit non-PCP backend is
rejected for a PCP target with a message naming it)."""

from __future__ import annotations

import pytest
from engine_utils import random_prompts

from tandem import LLM, SamplingParams
from tandem.attention.backend import registered_backends, select_backend

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("arch,kind", [("llama", "full_attention"), ("deepseek_v3", "mla_attention")])
@pytest.mark.parametrize("budget,reads", [(16, "gather"), (16, "in_place"), (16, "native"), (256, "default"),
                                          (256, "absorbed")])
def test_every_backend_of_a_kind_gives_the_same_tokens(tiny_checkpoints, monkeypatch, request, arch, kind, budget,
                                                     reads):
    """budget 16: every row is short (absorbed MLA); 256: whole prompts are long rows (prefix + causal diagonal
    on the paged backends, expanded MLA by the cost formula, or absorbed when forced; whole padded rows on the
    contiguous ones). Short rows read their keys by a padded gather, in place (cache views of every run of two
    blocks or more), or through the native CPU kernel (the default where it builds)."""
    from tandem import native

    if reads in ("gather", "in_place"):
        monkeypatch.setitem(native._state, "ok", False)
    else:
        request.getfixturevalue("native_kernels")
    if reads == "gather":
        monkeypatch.setattr("tandem.attention.metadata.IN_PLACE_MIN_KEYS", 10**9)
        monkeypatch.setattr("tandem.attention.metadata.GATHER_MAX_KEYS", 10**9)
    if reads == "in_place":
        monkeypatch.setattr("tandem.attention.metadata.IN_PLACE_MIN_KEYS", 0)
        monkeypatch.setattr("tandem.attention.metadata.MIN_RUN_KEYS", 32)
    if reads == "absorbed":
        monkeypatch.setattr("tandem.attention.backends.paged_mla.prefers_expanded", lambda *a: False)
    path = str(tiny_checkpoints(arch))
    prompts = random_prompts([5, 19, 33, 47], vocab_size=500, seed=17)
    results = {}
    for name, cls in registered_backends().items():
        if kind not in cls.kinds:
            continue
        llm = LLM(path, dtype="float32", max_num_batched_tokens=budget, attention_config={"backend": name})
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        results[name] = [o.outputs[0].token_ids for o in outs]
    assert len(results) >= 2, f"need a PCP-capable and a non-PCP backend for {kind}, have {sorted(results)}"
    first = next(iter(results.values()))
    assert all(r == first for r in results.values()), {n: r[0][:6] for n, r in results.items()}


@pytest.mark.parametrize("kind", ["full_attention", "mla_attention"])
def test_each_kind_has_honest_capable_and_incapable_backends(kind):
    backends = [c for c in registered_backends().values() if kind in c.kinds]
    assert any(c.supports_pcp() for c in backends) and any(not c.supports_pcp() for c in backends)
    assert select_backend(kind, None, use_pcp=True).supports_pcp()
    assert select_backend(kind, None, use_pcp=False).supports_pcp(), "automatic prefers PCP-capable backends"


def test_explicit_non_pcp_backend_for_pcp_target_is_rejected(tiny_checkpoints):
    with pytest.raises(ValueError, match="CONTIGUOUS_MLA.*does not support prefill context parallel"):
        LLM(str(tiny_checkpoints("deepseek_v3")), prefill_context_parallel_size=2,
            attention_config={"backend": "CONTIGUOUS_MLA"})


def test_unknown_backend_and_wrong_kind_are_named(tiny_checkpoints):
    with pytest.raises(ValueError, match="'FLASHY' is unknown: one of CONTIGUOUS_MLA"):
        LLM(str(tiny_checkpoints("llama")), attention_config={"backend": "FLASHY"})
    with pytest.raises(ValueError, match="'PAGED_MLA' does not serve full_attention"):
        LLM(str(tiny_checkpoints("llama")), attention_config={"backend": "PAGED_MLA"})
