"""The one place a drafter is chosen: the resolved draft mode and the speculative config -> a Proposer."""

from __future__ import annotations

from torch import nn

from tandem.attention.backend import AttentionBackend
from tandem.compilation.compile import compile_drafter
from tandem.config import EngineConfig
from tandem.layers.cpu_gemm import prepack_linears
from tandem.models.dspark import load_dspark_drafter
from tandem.models.eagle3 import load_eagle3_head
from tandem.models.registry import attention_kind
from tandem.spec_decode.draft_mode import DraftMode
from tandem.spec_decode.dspark_proposer import DSparkProposer
from tandem.spec_decode.eagle3_proposer import Eagle3Proposer
from tandem.spec_decode.mtp_catch_up import defers_at_k0, defers_step0
from tandem.spec_decode.mtp_proposer import MTPProposer
from tandem.spec_decode.ngram_proposer import NgramProposer
from tandem.spec_decode.proposer import NoProposer, Proposer


def build_proposer(config: EngineConfig, target: nn.Module, draft_mode: DraftMode,
                   target_backends: dict[str, type[AttentionBackend]]) -> Proposer:
    spec, model = config.speculative_config, config.model_config
    probabilistic = spec.draft_sample_method == "probabilistic"
    block_size = config.cache_config.block_size
    if spec.method == "mtp":
        assert draft_mode.backend is not None
        backends = {attention_kind(model.architecture): draft_mode.backend}
        return MTPProposer(target.mtp, backends, block_size, model.max_model_len, probabilistic,
                           sharded=draft_mode.mode == "sharded", target_backends=target_backends,
                           padded_size=config.compilation_config.padded_size,
                           defers=defers_step0(spec.method, draft_mode.mode,
                                               config.parallel_config.prefill_context_parallel_size))
    if spec.method == "eagle3":
        assert draft_mode.backend is not None and spec.model is not None
        head_dtype = spec.drafter_dtype(model.dtype)
        head = load_eagle3_head(spec.model, model, target.model.embed_tokens, config.device, head_dtype)
        # oneDNN-packed weights as the target's (its LM head is most of a draft pass's bytes)
        prepack_linears(head, lm_head_only=config.compilation_config.compiles,
                        amx=config.compilation_config.native_kernels)
        compile_drafter(head, "EAGLE-3 head", config.compilation_config)
        return Eagle3Proposer(head, target, {attention_kind(model.architecture): draft_mode.backend}, block_size,
                              model.max_model_len, probabilistic, sharded=draft_mode.mode == "sharded",
                              target_backends=target_backends, padded_size=config.compilation_config.padded_size,
                              defers=defers_step0(spec.method, draft_mode.mode,
                                                  config.parallel_config.prefill_context_parallel_size),
                              kv_dtype=config.cache_config.kv_dtype(head_dtype))
    if spec.method == "dspark":  # always replicated over the global batch (DESIGN §5)
        assert spec.model is not None
        drafter = load_dspark_drafter(spec.model, model, spec.max_num_speculative_tokens, config.device)
        return DSparkProposer(drafter, target, block_size, probabilistic,
                              defers=defers_at_k0(spec.method, spec.auto, draft_mode.mode,
                                                  config.parallel_config.prefill_context_parallel_size))
    if spec.method == "ngram":
        return NgramProposer(spec)
    return NoProposer()
