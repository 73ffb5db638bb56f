"""The work a model's config implies, for benchmark bounds: K/V bytes per token, the FLOPs a prefill needs, the
attention FLOPs a decode row spends per cached key. Read from config.json, so one formula serves MLA and GQA."""

from __future__ import annotations

from typing import Any

Config = dict[str, Any]


def is_mla(config: Config) -> bool:
    return "kv_lora_rank" in config


def head_dim(config: Config) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def kv_bytes_per_token(config: Config, elem: int) -> int:
    """Bytes one token's K/V takes in one layer: MLA's latent + rope key, or GQA's K and V heads."""
    if is_mla(config):
        return (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * elem
    num_kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * num_kv_heads * head_dim(config) * elem


def prefill_flops(config: Config, num_tokens: int) -> float:
    """The necessary work of prefilling one prompt: 2 x (linear weights a token passes through) per token (MLA's
    kv_b_proj once per token, as the expanded form runs it) + causal attention, 2 x heads x S (S + 1) / 2 x
    (qk + v head dims) per layer; a MoE layer counts its router and the experts a token is routed to."""
    layers, heads, s = config["num_hidden_layers"], config["num_attention_heads"], num_tokens
    qk, vd = attention_head_dims(config)
    return 2.0 * s * linear_weights_per_token(config) + layers * 2.0 * heads * s * (s + 1) / 2 * (qk + vd)


def linear_weights_per_token(config: Config) -> int:
    """Linear weights one token passes through, summed over layers: attention projections and mlp_weights (the LM
    head and the embedding table are not counted here)."""
    return config["num_hidden_layers"] * attention_weights(config) + mlp_weights(config)


def attention_weights(config: Config) -> int:
    """One layer's attention projections: MLA's q (through q_lora_rank if any), kv_a, kv_b and o; or GQA's q, k, v
    and o."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    if is_mla(config):
        nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
        lora, q_lora = config["kv_lora_rank"], config.get("q_lora_rank")
        q = h * q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
        return q + h * (lora + rope) + lora * heads * (nope + v) + heads * v * h
    d = head_dim(config)
    kv = config.get("num_key_value_heads") or heads
    return 2 * h * heads * d + 2 * h * kv * d


def attention_head_dims(config: Config) -> tuple[int, int]:
    """(qk, v) head dims of the expanded attention: MLA's nope + rope and v_head_dim, or GQA's head_dim twice."""
    if is_mla(config):
        return config["qk_nope_head_dim"] + config["qk_rope_head_dim"], config["v_head_dim"]
    return head_dim(config), head_dim(config)


def mlp_weights(config: Config) -> int:
    """MLP weights one token passes through, summed over layers: dense layers whole, MoE layers' router plus the
    routed and shared experts it uses (DeepSeek-V3's first_k_dense_replace / n_routed_experts names)."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    experts = config.get("n_routed_experts")
    dense = min(config.get("first_k_dense_replace", 0), layers) if experts else layers
    moe_per_token = 0
    if experts:
        used = config["num_experts_per_tok"] + config.get("n_shared_experts", 0)
        moe_per_token = h * experts + used * 3 * h * config["moe_intermediate_size"]
    return dense * 3 * h * config["intermediate_size"] + (layers - dense) * moe_per_token


def decode_attention_flops_per_key(config: Config) -> float:
    """FLOPs one decode row spends on one cached key over all layers: absorbed MLA scores and values over the
    latent (2 x heads x (2 L + rope)), or GQA's QK and PV (2 x heads x 2 head_dim)."""
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    if is_mla(config):
        return 2.0 * heads * (2 * config["kv_lora_rank"] + config["qk_rope_head_dim"]) * layers
    return 2.0 * heads * 2 * head_dim(config) * layers
