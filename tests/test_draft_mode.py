"""Draft-mode resolution (DESIGN §5): automatic selection shards, an explicit non-PCP backend replicates,
per-kind precedence over the speculative and global backends, DSpark always replicated, and the drafter's
config copy leaves the target's untouched."""

from __future__ import annotations

import pytest

from tandem.config import AttentionConfig, EngineConfig, ModelConfig, ParallelConfig, SpeculativeConfig
from tandem.spec_decode.draft_mode import drafter_config, resolve_draft_mode


@pytest.fixture(scope="module")
def mla_model(tiny_checkpoints) -> ModelConfig:
    return ModelConfig.from_path(str(tiny_checkpoints("deepseek_v3", num_mtp_layers=1)))


def _config(model: ModelConfig, method: str = "mtp", spec_backend: str | None = None, backend: str | None = None,
            per_kind: dict[str, str] | None = None) -> EngineConfig:
    return EngineConfig(
        model_config=model, parallel_config=ParallelConfig(prefill_context_parallel_size=2),
        speculative_config=SpeculativeConfig(method=method, num_speculative_tokens=2, attention_backend=spec_backend,
                                             model="drafter" if method == "dspark" else None),
        attention_config=AttentionConfig(backend=backend, backend_per_kind=per_kind or {}))


def test_automatic_selection_prefers_sharded(mla_model):
    mode = resolve_draft_mode(_config(mla_model))
    assert mode.mode == "sharded" and mode.backend is not None and mode.backend.supports_pcp()
    assert "automatic" in mode.reason


@pytest.mark.parametrize("spec_backend,mode_name", [("PAGED_MLA", "sharded"), ("CONTIGUOUS_MLA", "replicated")])
def test_explicit_backend_capability_decides_the_mode(mla_model, spec_backend, mode_name):
    mode = resolve_draft_mode(_config(mla_model, spec_backend=spec_backend))
    assert mode.mode == mode_name and mode.backend is not None and mode.backend.name == spec_backend
    assert spec_backend in mode.reason


def test_per_kind_backend_beats_speculative_and_global(mla_model):
    cfg = _config(mla_model, spec_backend="PAGED_MLA", backend="PAGED_MLA",
                  per_kind={"mla_attention": "CONTIGUOUS_MLA"})
    assert resolve_draft_mode(cfg).mode == "replicated"
    cfg = _config(mla_model, spec_backend="CONTIGUOUS_MLA", backend="PAGED_MLA",
                  per_kind={"mla_attention": "PAGED_MLA"})
    assert resolve_draft_mode(cfg).mode == "sharded"
    assert resolve_draft_mode(_config(mla_model, backend="CONTIGUOUS_MLA")).mode == "replicated"
    assert resolve_draft_mode(_config(mla_model, spec_backend="PAGED_MLA", backend="CONTIGUOUS_MLA")).mode == "sharded"


def test_dspark_is_replicated_and_ngram_has_no_drafter(mla_model):
    assert resolve_draft_mode(_config(mla_model, method="dspark")).mode == "replicated"
    assert resolve_draft_mode(_config(mla_model, method="ngram")).mode is None


def test_drafter_config_copy_leaves_target_untouched(mla_model):
    cfg = _config(mla_model, spec_backend="CONTIGUOUS_MLA")
    draft = drafter_config(cfg, resolve_draft_mode(cfg))
    assert draft.parallel_config.prefill_context_parallel_size == 1
    assert cfg.parallel_config.prefill_context_parallel_size == 2
    assert draft.model_config is cfg.model_config
    sharded = _config(mla_model)
    assert drafter_config(sharded, resolve_draft_mode(sharded)) is sharded


def test_replicated_draft_metadata_is_the_single_rank_metadata():
    """Under PCP=2 the target's rank-local metadata covers rank 1's DualChunkSwap segments only; the replicated
    drafter's metadata, rebuilt from the GLOBAL positions, sequence lengths and block tables, is field for field
    what a single-rank run builds for the same step."""
    import torch

    from tandem.attention.backends.paged_mla import PagedMLABackend
    from tandem.distributed.groups import Group
    from tandem.step_plan import RowSampling, ScheduledRow, StepPlan
    from tandem.worker.input_batch import global_attention_metadata, prepare_inputs
    from tandem.worker.pcp_hooks import make_pcp_hooks

    greedy = RowSampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, num_logprobs=None)
    plan = StepPlan([
        ScheduledRow("decode", [7, 8, 9], 20, [3, 4], is_prefill=False, sampling=greedy, num_draft_tokens=2),
        ScheduledRow("chunk", list(range(30, 70)), 16, [0, 1, 2, 5], is_prefill=True, sampling=greedy),
    ], num_spec_tokens=2)
    batch = prepare_inputs(plan, 16, "cpu")
    single = make_pcp_hooks(Group(0, 1), 16).maybe_partition(batch).attn_metadata
    local = make_pcp_hooks(Group(1, 2), 16).maybe_partition(batch).attn_metadata  # rank 1 of 2, no collective needed
    replicated = global_attention_metadata(batch, 16)
    for field in ("positions", "query_start_loc_cpu", "seq_lens_cpu", "block_table", "write_rows", "write_slots"):
        assert torch.equal(getattr(replicated, field), getattr(single, field)), field
    backend = PagedMLABackend  # the plan each backend builds from a batch depends on the batch alone
    planned, single_plan = replicated.metadata_for(backend), single.metadata_for(backend)
    assert (planned.native_rows is None) == (single_plan.native_rows is None)
    if single_plan.native_rows is not None:
        assert torch.equal(planned.native_rows, single_plan.native_rows)
    assert len(planned.groups) == len(single_plan.groups)
    for a, b in zip(planned.groups, single_plan.groups, strict=True):
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("token_idx", "token_valid", "kv_slots", "mask"))
    assert local.positions.shape[0] < batch.num_tokens  # the target's local view is a different thing
