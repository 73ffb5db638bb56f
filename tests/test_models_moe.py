"""MoE models (DeepSeek-V3, GLM-4.7-Flash, GLM-4.5) against transformers on tiny random checkpoints,
MTP layers against a re-computation from the checkpoint tensors, and strict loading of experts/MTP."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer
from transformers.models.glm4_moe_lite import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteDecoderLayer

from tandem.attention.backend import select_backend
from tandem.attention.forward_context import forward_context
from tandem.attention.metadata import build_attention_metadata
from tandem.config import ModelConfig
from tandem.distributed.groups import SINGLE_RANK, Group, ParallelGroups
from tandem.models.loader import WeightLoadError, build_model
from tandem.worker.kv_cache import allocate_kv_caches

BLOCK_SIZE, NUM_BLOCKS = 4, 8
VOCAB = 300
_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=256, n_routed_experts=8,
               num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
               attn_implementation="eager", experts_implementation="eager")
_MLA = dict(kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
_DS = dict(_MLA, first_k_dense_replace=1, n_group=2, topk_group=1)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}

# name -> (HF config class, HF model class, HF decoder layer class, config kwargs, released-style config.json)
CASES: dict[str, tuple[type, type, type, dict[str, Any], bool]] = {
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3DecoderLayer, _DS, False),
    "deepseek_v3_no_q_lora": (DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3DecoderLayer,
                              dict(_DS, q_lora_rank=None), False),
    "deepseek_v3_yarn": (DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3DecoderLayer,
                         dict(_DS, n_group=4, topk_group=2, rope_parameters=_YARN), True),
    "glm4_moe_lite": (Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, Glm4MoeLiteDecoderLayer, dict(_MLA), False),
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM, Glm4MoeDecoderLayer,
                 dict(head_dim=16, num_key_value_heads=2, attention_bias=True, use_qk_norm=True,
                      first_k_dense_replace=1), True),
}


def _randomize(module: nn.Module, gen: torch.Generator) -> None:
    """std-0.1 weights, norms near 1 and a random router bias, so routing and every layer matter."""
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if name.endswith("inv_freq"):
                continue
            noise = torch.randn(t.shape, generator=gen) * 0.1
            t.copy_(1 + noise if "norm" in name else noise)


def _released_style(cfg: dict[str, Any]) -> dict[str, Any]:
    # Released checkpoints: top-level rope_theta / rope_scaling / partial_rotary_factor, no rope_interleave.
    rope = dict(cfg.pop("rope_parameters"))
    cfg.pop("rope_interleave", None)
    cfg["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        cfg["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    kind = rope.pop("rope_type")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    return cfg


def _edit_config(folder: Path, edit: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def _build_checkpoint(case: str, folder: Path, num_mtp_layers: int = 0) -> tuple[nn.Module, Any]:
    cfg_cls, model_cls, _, kwargs, released = CASES[case]
    cfg = cfg_cls(**{**_COMMON, **kwargs})
    # num_mtp_layers (num_nextn_predict_layers, default 1) promises MTP tensors HF never saves.
    if hasattr(cfg, "num_mtp_layers"):
        cfg.num_mtp_layers = num_mtp_layers
    model = model_cls(cfg).eval()
    _randomize(model, torch.Generator().manual_seed(0))
    model.save_pretrained(folder)
    if released:
        _edit_config(folder, _released_style)
    return model, cfg


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors -> the released per-expert layout."""
    out = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            prefix, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("experts.down_proj"):
            out.update({f"{name[: -len('down_proj')]}{e}.down_proj.weight": t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return {k: v.contiguous() for k, v in out.items()}


def _add_mtp_layer(case: str, folder: Path, cfg: Any) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Append one MTP layer (checkpoint index num_hidden_layers) with its own embedding/head copies."""
    gen = torch.Generator().manual_seed(1)
    block = CASES[case][2](cfg, layer_idx=cfg.num_hidden_layers).eval()
    _randomize(block, gen)
    h, m = cfg.hidden_size, f"model.layers.{cfg.num_hidden_layers}."
    extra = {m + k: v for k, v in _per_expert(block.state_dict()).items()}
    extra.update({m + "enorm.weight": 1 + torch.randn(h, generator=gen) * 0.1,
                  m + "hnorm.weight": 1 + torch.randn(h, generator=gen) * 0.1,
                  m + "eh_proj.weight": torch.randn(h, 2 * h, generator=gen) * 0.1,
                  m + "shared_head.norm.weight": 1 + torch.randn(h, generator=gen) * 0.1,
                  m + "shared_head.head.weight": torch.randn(VOCAB, h, generator=gen) * 0.1,
                  m + "embed_tokens.weight": torch.randn(VOCAB, h, generator=gen) * 0.1})
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, **extra}, folder / "model.safetensors", metadata={"format": "pt"})
    return block, extra


def _load_tandem(folder: Path) -> tuple[nn.Module, dict[str, Any]]:
    model = build_model(ModelConfig.from_path(str(folder), dtype="float32"), SINGLE_RANK, with_mtp=True)
    backends = {kind: select_backend(kind, None, False) for kind in ("full_attention", "mla_attention")}
    allocate_kv_caches(model, backends, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    return model, backends


def _step(backends: dict[str, Any], positions: torch.Tensor, fn: Callable[[], Any]) -> Any:
    """Run `fn` over one request's new tokens at `positions` (slot = position; block table = identity)."""
    query_start_loc = torch.tensor([0, positions.numel()], dtype=torch.int32)
    seq_lens = torch.tensor([int(positions[-1]) + 1], dtype=torch.int32)
    block_table = torch.arange(NUM_BLOCKS, dtype=torch.int32)[None]
    meta = build_attention_metadata(positions, query_start_loc, seq_lens, block_table, BLOCK_SIZE,
                                    torch.arange(positions.numel()), positions.clone())
    with forward_context(meta, backends), torch.no_grad():
        return fn()


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_prefill_and_decode_logits_match_transformers(case: str, tmp_path: Path) -> None:
    hf, _ = _build_checkpoint(case, tmp_path)
    model, backends = _load_tandem(tmp_path)
    ids = torch.randint(0, VOCAB, (15,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]  # [15, V]
    # Prefill chunks [0, 7) and [7, 12), then three one-token decodes.
    spans = [(0, 7), (7, 12), (12, 13), (13, 14), (14, 15)]
    diffs = []
    for start, end in spans:
        pos = torch.arange(start, end)
        out = _step(backends, pos, lambda ids=ids[start:end], pos=pos: model.compute_logits(model(ids, pos)))
        diffs.append((out - ref[start:end]).abs().max().item())
    print(f"{case}: max |logits - transformers| per step {', '.join(f'{d:.1e}' for d in diffs)}")
    assert max(diffs) < 1e-4, f"{case}: logits differ from transformers by {diffs} (steps {spans})"


@pytest.mark.parametrize("case", ["deepseek_v3", "glm4_moe"])
def test_mtp_layer_loads_into_mtp_and_matches_recomputation(case: str, tmp_path: Path) -> None:
    hf, cfg = _build_checkpoint(case, tmp_path, num_mtp_layers=1)
    block, mtp = _add_mtp_layer(case, tmp_path, cfg)
    model, backends = _load_tandem(tmp_path)
    m, eps = f"model.layers.{cfg.num_hidden_layers}.", cfg.rms_norm_eps
    assert len(model.model.layers) == cfg.num_hidden_layers and len(model.mtp.layers) == 1
    assert torch.equal(model.mtp.layers[0].eh_proj.weight, mtp[m + "eh_proj.weight"])
    assert torch.equal(model.mtp.layers[0].shared_head.head.weight, mtp[m + "shared_head.head.weight"])

    t = 10
    ids = torch.randint(0, VOCAB, (t + 2,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        target_hidden = hf.model(ids[None, :t]).last_hidden_state[0]  # [t, H]
    # Draft step 0 over the prompt (ids shifted left, the sampled token last), then step 1 on its feedback.
    pos0 = torch.arange(t)
    logit_h0, feedback0 = _step(backends, pos0, lambda: model.mtp(ids[1:t + 1], pos0, target_hidden, 0))
    pos1 = torch.tensor([t])
    logit_h1, feedback1 = _step(backends, pos1, lambda: model.mtp(ids[t + 1:], pos1, feedback0[-1:], 1))

    def block_input(tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        emb = mtp[m + "embed_tokens.weight"][tokens] * (positions != 0).unsqueeze(-1)
        enorm, hnorm = _rms(emb, mtp[m + "enorm.weight"], eps), _rms(hidden, mtp[m + "hnorm.weight"], eps)
        return torch.cat((enorm, hnorm), -1) @ mtp[m + "eh_proj.weight"].T

    def run_block(x: torch.Tensor) -> torch.Tensor:  # HF's decoder layer over the whole sequence, causal
        n = x.shape[0]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        rope = hf.model.rotary_emb(x[None], torch.arange(n)[None])
        with torch.no_grad():
            return block(x[None], attention_mask=mask, position_embeddings=rope)[0]

    ref0 = run_block(block_input(ids[1:t + 1], pos0, target_hidden))
    x1 = block_input(ids[t + 1:], pos1, feedback0[-1:])
    ref1 = run_block(torch.cat((block_input(ids[1:t + 1], pos0, target_hidden), x1)))[-1:]
    checks = ((feedback0, logit_h0, ref0), (feedback1, logit_h1, ref1))
    for step, (got_h, got_logit_h, ref) in enumerate(checks):
        ref_logits = _rms(ref, mtp[m + "shared_head.norm.weight"], eps) @ mtp[m + "shared_head.head.weight"].T
        h_diff = (got_h - ref).abs().max().item()
        logit_diff = (model.mtp.compute_logits(got_logit_h, step) - ref_logits).abs().max().item()
        print(f"{case} MTP step {step}: max |feedback diff| {h_diff:.1e}, max |logits diff| {logit_diff:.1e}")
        assert h_diff < 1e-4 and logit_diff < 1e-4, f"{case} MTP step {step}: {h_diff=:.2e} {logit_diff=:.2e}"


def test_missing_expert_and_unexpected_mtp_tensors_are_named(tmp_path: Path) -> None:
    _, cfg = _build_checkpoint("deepseek_v3", tmp_path, num_mtp_layers=1)
    _add_mtp_layer("deepseek_v3", tmp_path, cfg)
    _edit_config(tmp_path, lambda c: {**c, "num_nextn_predict_layers": 0})
    with pytest.raises(WeightLoadError, match=r"unexpected.*model\.layers\.3\.eh_proj\.weight"):
        build_model(ModelConfig.from_path(str(tmp_path), dtype="float32"), SINGLE_RANK)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.3.")},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"missing.*model\.layers\.2\.mlp\.experts\.w13_weight"):
        build_model(ModelConfig.from_path(str(tmp_path), dtype="float32"), SINGLE_RANK)


def _rank_logits(folder: Path, layout: str, rank: int, store: Path, ids: torch.Tensor, results: Any) -> None:
    """One rank of a 2-rank gloo world: the model under `layout` ("tp" or "ep"), prefill + decode logits."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        group = Group(rank, 2, dist.group.WORLD)
        groups = ParallelGroups(tp=group) if layout == "tp" else ParallelGroups(ep=group)
        model = build_model(ModelConfig.from_path(str(folder), dtype="float32"), groups)
        backends = {kind: select_backend(kind, None, False) for kind in ("full_attention", "mla_attention")}
        allocate_kv_caches(model, backends, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
        out = [_step(backends, pos, lambda ids=ids[pos], pos=pos: model.compute_logits(model(ids, pos)))
               for pos in (torch.arange(0, 9), torch.arange(9, 10))]
        results.put((rank, torch.cat(out).numpy()))  # numpy: pickled by value, not via shared memory
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("case", "layout"),
                         [("deepseek_v3", "tp"), ("deepseek_v3", "ep"), ("glm4_moe", "tp")])
def test_two_rank_tensor_and_expert_parallel_match_transformers(case: str, layout: str,
                                                                 tmp_path: Path) -> None:
    hf, _ = _build_checkpoint(case, tmp_path)
    ids = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]  # [10, V]
    ctx = mp.get_context("fork")
    # a file store: a port picked free and released can be taken before rank 0 binds it
    results, store = ctx.Queue(), tmp_path / "rendezvous"
    procs = [ctx.Process(target=_rank_logits, args=(tmp_path, layout, rank, store, ids, results))
             for rank in range(2)]
    for p in procs:
        p.start()
    try:
        outs = dict(results.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, logits in sorted(outs.items()):
        diff = (torch.from_numpy(logits) - ref).abs().max().item()
        print(f"{case} {layout}=2 rank {rank}: max |logits - transformers| {diff:.1e}")
        assert diff < 1e-4, f"{case} {layout}=2 rank {rank}: logits differ from transformers by {diff:.2e}"
