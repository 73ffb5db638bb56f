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
