"""`tandem train draft-head`: the TTT unroll against a position-by-position reference, the draft vocabulary's
d2t/t2d, the EAGLE-3 folder format vLLM reads, and an end-to-end run on a tiny Llama whose loss falls and whose
trained head accepts more than an untrained one."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tandem.entrypoints.cli import main as cli_main
from tandem.train.draft_head.export import load_head
from tandem.train.draft_head.features import FeatureStore
from tandem.train.draft_head.head import DraftHead, HeadShape, rope, step0_logits
from tandem.train.draft_head.loop import batches
from tandem.train.draft_head.objective import evaluate, init_from_target_layer, init_head
from tandem.train.draft_head.pipeline import target_embed_and_head, target_layer_tensors
from tandem.train.draft_head.target_config import aux_layer_ids, head_shape, read_target_config
from tandem.train.draft_head.vocab import build_vocab

SHAPE = HeadShape(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  rms_norm_eps=1e-6, rope_theta=10000.0, num_aux_layers=3, draft_vocab_size=40)


def _random_head(seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(SHAPE)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape) * (0.2 if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
    return head


def _hf_rope(x: torch.Tensor, position: int) -> torch.Tensor:
    """transformers' Llama RoPE on x: [heads, D] at one position."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=SHAPE.num_attention_heads * SHAPE.head_dim, head_dim=SHAPE.head_dim,
                      num_attention_heads=SHAPE.num_attention_heads, rope_theta=SHAPE.rope_theta)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, torch.tensor([[position]]))
    rotated, _ = apply_rotary_pos_emb(x[None, :, None, :], x[None, :, None, :], cos, sin, unsqueeze_dim=1)
    return rotated[0, :, 0, :]


def _reference_ttt(head: DraftHead, embed: torch.Tensor, aux: torch.Tensor, ids: torch.Tensor, num_steps: int,
                   ) -> list[torch.Tensor]:
    """Inference's view, one query at a time: step j at index t sits at position t + j, reads id ids[t + j] and
    the previous step's prenorm at t, and attends to step-0 keys at indices <= t plus steps 1..j's keys at t."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    group = SHAPE.num_attention_heads // SHAPE.num_key_value_heads
    t_len = aux.shape[0]
    hidden = head.fc(aux)  # [T, H]
    keys: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    out = []
    for j in range(num_steps):
        queries = []
        for t in range(t_len):
            a = torch.cat((layer.input_layernorm(embed[ids[t + j]]), layer.hidden_norm(hidden[t])))
            q = _hf_rope(attn.q_proj(a).view(SHAPE.num_attention_heads, -1), t + j)
            k = _hf_rope(attn.k_proj(a).view(SHAPE.num_key_value_heads, -1), t + j)
            keys[(j, t)] = (k, attn.v_proj(a).view(SHAPE.num_key_value_heads, -1))
            queries.append(q)
        prenorms, logits = [], []
        for t in range(t_len):
            visible = [keys[(0, u)] for u in range(t + 1)] + [keys[(i, t)] for i in range(1, j + 1)]
            k = torch.stack([kv[0] for kv in visible])  # [N, kv_heads, D]
            v = torch.stack([kv[1] for kv in visible])
            heads = []
            for h in range(SHAPE.num_attention_heads):
                w = torch.softmax(k[:, h // group] @ queries[t][h] * SHAPE.head_dim ** -0.5, dim=0)
                heads.append(w @ v[:, h // group])
            r2 = attn.o_proj(torch.cat(heads)) + hidden[t]
            prenorm = layer.mlp(layer.post_attention_layernorm(r2)) + r2
            prenorms.append(prenorm)
            logits.append(head.lm_head(head.norm(prenorm)))
        hidden = torch.stack(prenorms)
        out.append(torch.stack(logits))
    return out


def test_ttt_unroll_matches_a_query_by_query_reference():
    head = _random_head()
    torch.manual_seed(1)
    num_steps, t_len = 3, 7
    embed = torch.randn(50, SHAPE.hidden_size)
    aux = torch.randn(t_len, 3 * SHAPE.hidden_size)
    ids = torch.randint(0, 50, (t_len + num_steps - 1,))
    with torch.no_grad():
        got = head.ttt(embed, aux[None], ids[None], num_steps)
        want = _reference_ttt(head, embed, aux, ids, num_steps)
    for j in range(num_steps):
        diff = (got[j][0] - want[j]).abs().max().item()
        assert diff < 1e-4, f"TTT step {j}: max |batched - reference| = {diff:.2e}"


def test_right_padding_does_not_change_valid_rows():
    head = _random_head()
    torch.manual_seed(2)
    embed = torch.randn(50, SHAPE.hidden_size)
    aux = torch.randn(1, 9, 3 * SHAPE.hidden_size)
    ids = torch.randint(0, 50, (1, 11))
    with torch.no_grad():
        short = head.ttt(embed, aux[:, :5], ids[:, :7], 3)
        padded = head.ttt(embed, aux, ids, 3)
    for j in range(3):
        diff = (short[j][0] - padded[j][0, :5]).abs().max().item()
        assert diff < 1e-5, f"step {j}: padding after a row changed its valid positions by {diff:.2e}"


def test_rope_matches_transformers():
    torch.manual_seed(3)
    x = torch.randn(SHAPE.num_attention_heads, SHAPE.head_dim)
    got = rope(x[None, None], torch.tensor([[13]]), SHAPE.rope_theta)[0, 0]
    assert torch.allclose(got, _hf_rope(x, 13), atol=1e-5), (got - _hf_rope(x, 13)).abs().max()


def test_target_layer_init_computes_that_target_layer(tiny_checkpoints):
    """With the embedding half of q/k/v at zero, a head initialised from the target's last aux layer computes at step 0
    exactly that layer over the aux stream: its pre-norm hidden is the target's stream entering the next layer."""
    from transformers import AutoModelForCausalLM

    target = tiny_checkpoints("llama", overrides={"num_hidden_layers": 6})
    raw = read_target_config(target)
    layers = aux_layer_ids(raw)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    torch.manual_seed(4)
    ids = torch.randint(0, raw["vocab_size"], (1, 12))
    with torch.no_grad():
        streams = model(ids, output_hidden_states=True).hidden_states  # [L + 1] x [1, T, H]
    aux = torch.cat([streams[i] for i in layers], dim=-1)  # [1, T, 3H]
    head = DraftHead(head_shape(raw, 64))
    embed, lm_head = target_embed_and_head(target)
    init_head(head, lm_head, build_vocab(Counter(), 64, raw["vocab_size"], [raw["eos_token_id"]]), seed=0)
    init_from_target_layer(head, *target_layer_tensors(target, layers[-1]))
    with torch.no_grad():
        for proj in (head.midlayer.self_attn.q_proj, head.midlayer.self_attn.k_proj, head.midlayer.self_attn.v_proj):
            proj.weight[:, :raw["hidden_size"]] = 0.0
        hidden = head.ttt_hidden(embed, aux, ids, 1)[0]  # [1, T, H]
    want = streams[layers[-1] + 1]
    assert torch.allclose(hidden, want, atol=1e-4, rtol=1e-4), (hidden - want).abs().max()


def test_draft_vocab_d2t_t2d_worked_example():
    vocab = build_vocab(Counter({4: 10, 5: 7, 3: 1}), 3, 6, always=[1])
    assert vocab.target_ids.tolist() == [1, 4, 5]
    assert vocab.d2t.tolist() == [1, 3, 3]
    assert vocab.t2d.tolist() == [False, True, False, False, True, True]
    assert vocab.to_draft().tolist() == [-1, 0, -1, -1, 1, 2]
    with pytest.raises(ValueError, match="draft_vocab_size=7 is not allowed"):
        build_vocab(Counter(), 7, 6, always=[])


def test_unknown_architecture_and_missing_folder_are_named(tmp_path):
    with pytest.raises(ValueError, match="TARGET=.* is not allowed: a Hugging Face model folder that exists"):
        read_target_config(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"architectures=\['GPT2LMHeadModel'\] is not allowed: one of "
                                         r"\['LlamaForCausalLM', 'Qwen3ForCausalLM'\]"):
        read_target_config(tmp_path)
    assert cli_main(["train", "draft-head", str(tmp_path / "nope"), "--out", str(tmp_path / "head")]) == 2


@pytest.fixture(scope="module")
def trained(tiny_checkpoints, tmp_path_factory) -> tuple[Path, Path, Path]:
    target = tiny_checkpoints("llama", overrides={"num_hidden_layers": 6})
    root = tmp_path_factory.mktemp("draft_head")
    gsm8k = root / "train.jsonl"
    questions = [f"Tom has {i} apples and buys {i + 3} more. How many apples does he have?" for i in range(24)]
    gsm8k.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in questions))
    out, work = root / "head", root / "work"
    torch.set_num_threads(1)
    rc = cli_main(["train", "draft-head", str(target), "--out", str(out), "--work", str(work), "--gsm8k", str(gsm8k),
                   "--num-prompts", "16", "--max-tokens", "24", "--draft-vocab-size", "256", "--epochs", "20",
                   "--batch-tokens", "512", "--lr", "3e-3", "--threads", "1"])
    assert rc == 0
    return target, out, work


def test_written_folder_has_the_eagle3_format(trained):
    target, out, _ = trained
    raw = json.loads((target / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    assert cfg["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [2, 3, 3]}
    assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (raw["vocab_size"], 256, 64)
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is False
    h, heads, kv, d, inter = 64, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], 128
    want = {
        "midlayer.self_attn.q_proj.weight": (heads * d, 2 * h), "midlayer.self_attn.k_proj.weight": (kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv * d, 2 * h), "midlayer.self_attn.o_proj.weight": (h, heads * d),
        "midlayer.mlp.gate_proj.weight": (inter, h), "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter), "midlayer.input_layernorm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
        "fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (256, h),
        "d2t": (256,), "t2d": (raw["vocab_size"],),
    }
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == want
    dtypes = {k: v.dtype for k, v in tensors.items()}
    assert dtypes.pop("d2t") == torch.int64 and dtypes.pop("t2d") == torch.bool
    assert set(dtypes.values()) == {torch.bfloat16}
    target_ids = torch.arange(256) + tensors["d2t"]
    assert bool((target_ids[1:] > target_ids[:-1]).all()), "draft ids must be sorted by ascending target id"
    assert torch.equal(tensors["t2d"].nonzero().flatten(), target_ids), "d2t and t2d disagree"
    assert bool(tensors["t2d"][raw["eos_token_id"]]), "the end token must be in the draft vocabulary"


def test_loss_falls_and_trained_head_accepts_more_than_untrained(trained):
    target, out, work = trained
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    evals = [r for r in log if "eval_loss" in r]
    assert evals[-1]["eval_loss"] < 0.7 * evals[0]["eval_loss"], f"held-out loss {evals[0]['eval_loss']} -> " \
        f"{evals[-1]['eval_loss']}"

    head, vocab, _ = load_head(out)
    rows = [(Path(p).with_suffix(""), [json.loads(line) for line in p.read_text().splitlines()])
            for p in sorted((work / "data").glob("*.jsonl"))]
    store = FeatureStore([(work / "features" / stem.name, [r for r in rs if len(r["ids"]) - r["response_start"] >= 4])
                          for stem, rs in rows])
    embed, lm_head = target_embed_and_head(target)
    untrained = DraftHead(head.shape)
    init_head(untrained, lm_head, vocab, seed=0)
    every = batches(store, list(range(len(store))), 512, None)
    after = evaluate(head, embed, store, every, vocab, vocab.to_draft(), 3)["eval_accept_len"]
    before = evaluate(untrained, embed, store, every, vocab, vocab.to_draft(), 3)["eval_accept_len"]
    assert after > before + 0.2, f"simulated acceptance length: untrained {before:.3f}, trained {after:.3f}"


def test_step0_logits_are_the_first_ttt_step(trained):
    target, out, work = trained
    head, _, _ = load_head(out)
    embed, _ = target_embed_and_head(target)
    torch.manual_seed(4)
    aux = torch.randn(6, 3 * head.shape.hidden_size)
    ids = torch.randint(0, embed.shape[0], (6,))
    logits = step0_logits(head, embed, aux, ids)
    assert logits.shape == (6, head.shape.draft_vocab_size)
    with torch.no_grad():
        full = head.ttt(embed, aux[None], torch.cat((ids, ids[:2]))[None], 3)[0][0]
    assert torch.allclose(logits, full, atol=1e-5)


def test_draft_step0_logits_from_folders_match_the_training_forward(trained):
    from tandem.train.draft_head.reference import draft_step0_logits

    target, out, work = trained
    rows = [r for r in map(json.loads, (work / "data" / "gsm8k_00000.jsonl").read_text().splitlines())
            if len(r["ids"]) - r["response_start"] >= 4]  # the rows the features were cached for
    ids = rows[0]["ids"]
    logits = draft_step0_logits(target, out, ids)
    head, _, _ = load_head(out)
    embed, _ = target_embed_and_head(target)
    aux = FeatureStore([(work / "features" / "gsm8k_00000", rows)]).get(0)[0].float()  # cached bf16 aux
    cached = step0_logits(head, embed, aux[:-1], torch.tensor(ids[1:]))
    assert logits.shape == (len(ids) - 1, 256)
    # bf16 caching of the aux states is the only difference
    assert (logits.argmax(-1) == cached.argmax(-1)).float().mean() > 0.9


def test_engine_drafts_with_a_trained_head_equal_its_training_forward(trained, monkeypatch):
    """The link between training and serving: tandem's engine, drafting with the written head, proposes at every
    step the argmax of the training module's step-0 logits for the same context (mapped by d2t), and is accepted."""
    from engine_utils import record_steps

    from tandem import LLM, SamplingParams
    from tandem.train.draft_head.reference import draft_step0_logits

    target, out, work = trained
    rows = [json.loads(line) for line in (work / "data" / "gsm8k_00000.jsonl").read_text().splitlines()]
    prompts = [r["ids"][: r["response_start"]] for r in rows[:3]]
    llm = LLM(str(target), dtype="float32", speculative_config={"method": "eagle3", "model": str(out),
                                                               "num_speculative_tokens": 1})
    steps = record_steps(llm, monkeypatch)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    full = {o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in outs}
    d2t = load_head(out)[1].d2t
    emitted = {rid: 0 for rid in full}
    checked = 0
    for plan, step in steps:
        rows_ = [r for r in plan.rows if r.sampling is not None]
        for row, tokens, drafts in zip(rows_, step.sampled_token_ids, step.draft_token_ids, strict=True):
            emitted[row.request_id] += len(tokens)
            context = full[row.request_id][: len(prompts[int(row.request_id)]) + emitted[row.request_id]]
            if drafts and len(context) < len(full[row.request_id]):
                best = int(draft_step0_logits(target, out, context)[-1].argmax())
                assert drafts == [best + int(d2t[best])], f"request {row.request_id} after {len(context)} tokens"
                checked += 1
    assert checked >= 6
    m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()}
    assert m["tandem:spec_decode_num_accepted_tokens"] > 0


def test_init_from_continues_where_the_head_left_off(trained, tmp_path):
    """`--init-from`: a run continued from a trained head starts at that head's held-out loss (every weight and
    every vocabulary row carried over), far below a fresh start's."""
    import shutil

    target, out, work = trained
    warm_work = tmp_path / "work"  # the same data and features, no checkpoint to resume
    for part in ("data", "features"):
        shutil.copytree(work / part, warm_work / part)
    rc = cli_main(["train", "draft-head", str(target), "--out", str(tmp_path / "head"), "--work", str(warm_work),
                   "--gsm8k", str(work.parent / "train.jsonl"), "--num-prompts", "16", "--max-tokens", "24",
                   "--draft-vocab-size", "256", "--epochs", "20", "--batch-tokens", "512", "--lr", "1e-5",
                   "--threads", "1", "--init-from", str(out), "--max-steps", "3"])
    assert rc == 0
    first = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    warm = [json.loads(line) for line in (warm_work / "train_log.jsonl").read_text().splitlines()]
    assert [r["lm_head_rows_copied"] for r in warm if r["stage"] == "init_from"] == [256]
    fresh_start = [r for r in first if "eval_loss" in r][0]["eval_loss"]
    trained_end = [r for r in first if "eval_loss" in r][-1]["eval_loss"]
    warm_start = [r for r in warm if "eval_loss" in r][0]["eval_loss"]
    assert warm_start == pytest.approx(trained_end, rel=0.03), (fresh_start, trained_end, warm_start)
    assert [r["step"] for r in warm if r["stage"] == "eval"][-1] == 3, "--max-steps 3 ends the schedule at step 3"


def test_init_from_a_head_of_another_target_is_refused(trained, tmp_path):
    from tandem.assets import SMOLLM2_EAGLE3
    from tandem.train.draft_head.objective import warm_start

    head, vocab, config = load_head(trained[1])
    with pytest.raises(ValueError, match=r"--init-from .* does not fit this target: its head shape is .*"
                                         r"hidden_size=576"):
        warm_start(head, vocab, SMOLLM2_EAGLE3, config["vocab_size"], config["eagle_aux_hidden_state_layer_ids"])
    with pytest.raises(ValueError, match=r"its eagle_aux_hidden_state_layer_ids is \[2, 3, 3\], this target "
                                         r"needs \[1, 2, 3\]"):
        warm_start(head, vocab, trained[1], config["vocab_size"], [1, 2, 3])
    rc = cli_main(["train", "draft-head", str(trained[0]), "--out", str(tmp_path / "h"),
                   "--init-from", str(tmp_path / "missing")])
    assert rc == 2
    assert cli_main(["train", "draft-head", str(trained[0]), "--out", str(tmp_path / "h"), "--max-steps", "0"]) == 2


def test_a_later_stage_writes_only_questions_no_earlier_stage_answered(trained, tmp_path):
    """`--prompt-offset` (same seed: the questions after the first run's) and `--exclude-data` (any seed: the
    questions not in the first run's data/) both give the 16 of 24 questions the first run (8) left unanswered."""
    from tandem.train.draft_head.distill import Distiller, DistillPlan, read_rows

    target, _, work = trained
    gsm8k = work.parent / "train.jsonl"

    def prompts(work_dir: Path) -> set[tuple[int, ...]]:
        rows = read_rows(sorted((work_dir / "data").glob("gsm8k_*.jsonl")))
        return {tuple(r["ids"][:r["response_start"]]) for r in rows}

    first = prompts(work)
    assert len(first) == 8
    runs = {"offset": DistillPlan(target, tmp_path / "offset", gsm8k, 100, 0.0, 4, seed=0, prompt_offset=8),
            "exclude": DistillPlan(target, tmp_path / "exclude", gsm8k, 100, 0.0, 4, seed=5, exclude=(work,))}
    later = {name: prompts(Distiller(plan).run()[0].parent.parent) for name, plan in runs.items()}
    for name, got in later.items():
        assert len(got) == 16 and not got & first, name
    assert later["offset"] == later["exclude"]
    with pytest.raises(ValueError, match=r"--exclude-data .*nothing: no data/ folder there"):
        Distiller(DistillPlan(target, tmp_path / "x", gsm8k, 4, 0.0, 4, seed=0, exclude=(tmp_path / "nothing",))).run()


def test_renumber_redraws_each_quantity_keeping_digits_and_repeats():
    """A renumbered question keeps its words, gives each distinct number a new one of as many digits (the same one
    wherever it repeats), is reproducible from the seed, and differs between seeds."""
    import random
    import re

    from tandem.train.draft_head.distill import renumber

    q = "Ann has 12 pens and 305 clips; she gives 12 pens and 0 clips to 7 friends, each 1.5 hours."
    outs = [renumber(q, random.Random(s)) for s in range(50)]
    assert outs[0] == renumber(q, random.Random(0))
    assert len(set(outs)) > 40
    for out in outs:
        assert re.sub(r"\d+", "#", out) == re.sub(r"\d+", "#", q)
        nums = re.findall(r"\d+", out)
        assert [len(n) for n in nums] == [len(n) for n in re.findall(r"\d+", q)]
        assert nums[0] == nums[2] and nums[3] == "0" and all(n[0] != "0" for n in nums if n != "0")


def test_reuse_data_trains_on_an_earlier_runs_answers_too(trained, tmp_path):
    """`--reuse-data WORK`: the earlier run's finished chunks join this run's sequences (and no chunk of theirs is
    generated or featurised again); a folder without finished chunks is refused by name."""
    target, _, work = trained
    gsm8k = work.parent / "train.jsonl"
    earlier = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    earlier_seqs = next(r["sequences"] for r in earlier if r["stage"] == "distill")
    later = tmp_path / "later-work"
    rc = cli_main(["train", "draft-head", str(target), "--out", str(tmp_path / "later"), "--work", str(later),
                   "--gsm8k", str(gsm8k), "--num-prompts", "4", "--magpie-share", "0", "--max-tokens", "8",
                   "--renumber", "--seed", "3", "--draft-vocab-size", "256", "--epochs", "1", "--max-steps", "2",
                   "--batch-tokens", "512", "--threads", "1", "--reuse-data", str(work)])
    assert rc == 0
    log = [json.loads(line) for line in (later / "train_log.jsonl").read_text().splitlines()]
    distill = next(r for r in log if r["stage"] == "distill")
    # this run's own 4 answers, less any under MIN_RESPONSE_TOKENS (the tiny random target stops early at times)
    assert distill["reused_sequences"] == earlier_seqs and 1 <= distill["sequences"] - earlier_seqs <= 4
    assert next(r for r in log if r["stage"] == "features")["computed_chunks"] == 1
    assert (tmp_path / "later" / "model.safetensors").is_file()
    rc = cli_main(["train", "draft-head", str(target), "--out", str(tmp_path / "x"), "--gsm8k", str(gsm8k),
                   "--num-prompts", "4", "--magpie-share", "0", "--max-tokens", "8", "--max-steps", "1",
                   "--reuse-data", str(tmp_path / "nothing")])
    assert rc == 2
