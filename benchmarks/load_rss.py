"""Peak resident memory per rank while loading weights at TP = 1 and TP = 2: each rank reads only its slices
(`safe_open(...).get_slice`), so the weights part of a TP=2 rank should be about half a TP=1 rank's.

    .venv/bin/python benchmarks/load_rss.py [--hidden 1024 --layers 8 --vocab 32000 --dtype bfloat16]

Model: a random Llama checkpoint of the given size written to a temporary folder (no tokenizer is needed to load
weights). Each rank is a fresh spawned process that builds the model with its TP rank (loading runs no
collective, so no process group is needed); the line reports VmHWM (peak RSS, file pages of the mmapped shard
included) minus the RSS after imports, i.e. what loading added, per rank.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def write_checkpoint(folder: Path, hidden: int, layers: int, vocab: int, dtype: torch.dtype) -> int:
    heads, kv_heads, inter = hidden // 64, hidden // 128, 4 * hidden
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 2048,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * 0.02).to(dtype)

    head_dim = hidden // heads
    tensors = {"model.embed_tokens.weight": rand(vocab, hidden), "lm_head.weight": rand(vocab, hidden),
               "model.norm.weight": rand(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
                    p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
                    p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
                    p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                    p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
                    p + "mlp.down_proj.weight": rand(hidden, inter),
                    p + "input_layernorm.weight": rand(hidden), p + "post_attention_layernorm.weight": rand(hidden)}
    save_file(tensors, str(folder / "model.safetensors"))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _load_rank(folder: str, rank: int, size: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    from tandem.config import ModelConfig
    from tandem.distributed.groups import Group, ParallelGroups
    from tandem.models.loader import build_model

    config = ModelConfig.from_path(folder)
    before = _status_kib("VmRSS")
    model = build_model(config, ParallelGroups(tp=Group(rank, size)))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out.put((rank, (_status_kib("VmHWM") - before) / 1024, param_bytes / 2**20))


def measure(folder: str, size: int) -> list[tuple[int, float, float]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_load_rank, args=(folder, r, size, out)) for r in range(size)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        total = write_checkpoint(Path(tmp), args.hidden, args.layers, args.vocab, getattr(torch, args.dtype))
        print(f"checkpoint: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.dtype}, "
              f"{total / 2**20:.0f} MiB")
        peaks = {}
        for size in (1, 2):
            rows = measure(tmp, size)
            peaks[size] = max(r[1] for r in rows)
            for rank, peak, params in rows:
                print(f"TP={size} rank {rank}: load added {peak:.0f} MiB peak RSS (parameters {params:.0f} MiB)")
        print(f"load peak RSS per rank: TP=1 {peaks[1]:.0f} MiB, TP=2 {peaks[2]:.0f} MiB "
              f"({peaks[2] / peaks[1]:.2f}x)")


if __name__ == "__main__":
    main()
