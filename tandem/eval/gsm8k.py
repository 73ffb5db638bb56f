"""`tandem eval gsm8k`: few-shot GSM8K accuracy plus speculative-decoding acceptance, in-process or against an
OpenAI-compatible server, and the seed's configuration matrix (`--matrix`).
Scope: prompts, running, scoring and the results table; prompt layout and answer extraction live in
tandem/data/gsm8k.py.

Every question gets the same `num_shots` examples (drawn once with `seed`), so their shared prefix is served
from the prefix cache after the first request.
"""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem.data.gsm8k import (
    SHARED_GSM8K,
    STOP_STRINGS,
    Problem,
    extract_answer,
    few_shot_prompt,
    load_jsonl,
    normalize_number,
    synthetic_split,
)

SYNTHETIC = "synthetic"


@dataclass
class EvalResult:
    name: str
    correct: int = 0
    total: int = 0
    invalid: int = 0
    acceptance_rate: float | None = None
    acceptance_length: float | None = None
    elapsed_s: float = 0.0
    output_tokens: int = 0
    note: str = ""  # why a configuration did not run
    answers: list[str | None] = field(default_factory=list, repr=False)

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


SYNTHETIC_POOL = "synthetic (tandem's own 'shots' split, 64 examples)"


def few_shot_pool(data: str, shots_data: str | None, allow_synthetic_shots: bool = False
                  ) -> tuple[str, list[Problem]]:
    """(the pool's name, its examples): `shots_data`, else synthetic for synthetic questions, else GSM8K train
    from ../shared. Real questions never silently get synthetic shots: that needs `allow_synthetic_shots`."""
    if shots_data:
        return shots_data, load_jsonl(shots_data)
    if data == SYNTHETIC:
        return SYNTHETIC_POOL, synthetic_split("shots", 64)
    default_pool = SHARED_GSM8K / "train.jsonl"
    if default_pool.is_file():
        return str(default_pool), load_jsonl(default_pool)
    if not allow_synthetic_shots:
        raise ValueError(f"--data={data!r} holds real questions but the few-shot pool {default_pool} is missing: "
                         "give --shots-data FILE (GSM8K train .jsonl), or --allow-synthetic-shots to pair these "
                         "questions with tandem's synthetic examples")
    return SYNTHETIC_POOL + ", asked for by --allow-synthetic-shots", synthetic_split("shots", 64)


def load_eval_data(data: str, shots_data: str | None, num_questions: int | None, num_shots: int, seed: int,
                   allow_synthetic_shots: bool = False) -> tuple[list[Problem], list[Problem], str]:
    """(questions, few-shot examples, the few-shot pool's name). `data` is a GSM8K-layout .jsonl file or
    "synthetic" (the project's own split, so the command runs without ../shared)."""
    questions = synthetic_split("test", num_questions or 200) if data == SYNTHETIC else load_jsonl(data)
    pool_name, pool = few_shot_pool(data, shots_data, allow_synthetic_shots)
    if num_questions is not None:
        questions = questions[:num_questions]
    if num_shots > len(pool):
        raise ValueError(f"--num-shots={num_shots}: the few-shot pool {pool_name} has only {len(pool)} examples")
    shots = random.Random(seed).sample(pool, num_shots)
    return questions, shots, pool_name


def build_prompts(questions: list[Problem], shots: list[Problem], chat_model: str | None = None) -> list[str]:
    """Few-shot text prompts, or with `chat_model` each question as a user turn through that folder's chat template,
    the shots before it as user/assistant turns (lm-eval's fewshot_as_multiturn)."""
    if chat_model is None:
        return [few_shot_prompt(shots, q.question) for q in questions]
    from tandem.entrypoints.openai.chat_template import ChatTemplate

    template = ChatTemplate(chat_model)
    turns = [m for s in shots for m in ({"role": "user", "content": s.question},
                                        {"role": "assistant", "content": s.answer})]
    return [template.render([*turns, {"role": "user", "content": q.question}]) for q in questions]


def stop_strings(chat: bool) -> list[str] | None:
    """A chat answer ends at the model's end of turn (its EOS); a few-shot one before the next example."""
    return None if chat else STOP_STRINGS


def score(result: EvalResult, questions: list[Problem], completions: list[str]) -> EvalResult:
    result.total = len(questions)
    for q, text in zip(questions, completions, strict=True):
        got = extract_answer(text)
        result.answers.append(got)
        if got is None:
            result.invalid += 1
        elif got == normalize_number(q.target):
            result.correct += 1
    return result


def run_in_process(name: str, engine_kwargs: dict[str, Any], questions: list[Problem], shots: list[Problem],
                   max_tokens: int, temperature: float, seed: int, chat: bool = False) -> EvalResult:
    from tandem import LLM, SamplingParams

    llm = LLM(**engine_kwargs)
    try:
        # the model's tokenizer adds its BOS, if it has one
        prompts = build_prompts(questions, shots, llm.engine.config.model_config.model if chat else None)
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, stop=stop_strings(chat), seed=seed)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=True)
        result = EvalResult(name, elapsed_s=time.perf_counter() - start)
        errors = [o.error for o in outs if o.error is not None]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
        result.output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        if metrics.get("tandem:spec_decode_num_drafts"):
            result.acceptance_rate = float(metrics["tandem:spec_decode_acceptance_rate"])  # type: ignore[arg-type]
            result.acceptance_length = float(metrics["tandem:spec_decode_mean_acceptance_length"])  # type: ignore[arg-type]
        return score(result, questions, [o.outputs[0].text for o in outs])
    finally:
        llm.shutdown()


def _scrape_spec_counters(url: str) -> dict[str, float]:
    """The spec-decode counters of a tandem or vLLM server's Prometheus /metrics ({} when it has none)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or "spec_decode_num_" not in line or "_per_pos" in line:
            continue
        key, _, value = line.rpartition(" ")
        short = key.split("{")[0].split(":")[-1].removesuffix("_total")
        counters[short] = counters.get(short, 0.0) + float(value)
    return counters


def run_against_url(name: str, url: str, model: str | None, questions: list[Problem], shots: list[Problem],
                    max_tokens: int, temperature: float, seed: int, concurrency: int) -> EvalResult:
    from tqdm import tqdm

    prompts = build_prompts(questions, shots)
    before = _scrape_spec_counters(url)

    def complete(prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stop": STOP_STRINGS,
                "seed": seed}
        if model:
            body["model"] = model
        req = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            return json.loads(resp.read())["choices"][0]["text"]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        completions = list(tqdm(pool.map(complete, prompts), total=len(prompts), desc="GSM8K"))
    result = EvalResult(name, elapsed_s=time.perf_counter() - start)
    after = _scrape_spec_counters(url)
    drafts = after.get("spec_decode_num_drafts", 0.0) - before.get("spec_decode_num_drafts", 0.0)
    if drafts > 0:
        accepted = after["spec_decode_num_accepted_tokens"] - before.get("spec_decode_num_accepted_tokens", 0.0)
        proposed = after["spec_decode_num_draft_tokens"] - before.get("spec_decode_num_draft_tokens", 0.0)
        result.acceptance_rate = accepted / proposed
        result.acceptance_length = 1 + accepted / drafts
    return score(result, questions, completions)


# ------------------------------------------------------------------------------------------------------
# The seed's table: one row per configuration, acceptance deltas against the TP row.
# ------------------------------------------------------------------------------------------------------

DYNAMIC_K = [[8, 3], [16, 2], [32, 1]]  # K=3 for 1-8 running requests, 2 for 9-16, 1 for 17-32


# the explicit non-PCP backend that makes a drafter run replicated, by the target's attention kind
REPLICATED_DRAFT_BACKEND = {"mla_attention": "CONTIGUOUS_MLA", "full_attention": "CONTIGUOUS_SDPA"}


def matrix_configs(k: int, drafter: dict[str, Any] | None = None, attention_kind: str = "mla_attention",
                   tp: int = 2, pcp_sizes: tuple[int, ...] = (2,)) -> list[tuple[str, dict[str, Any]]]:
    """(row name, engine kwargs on top of the base ones) in the seed's order, then the draft-mode rows, for each PCP
    size. `drafter`: the speculative config's method (and model) the rows use; MTP (plus a DSpark row) by default."""
    spec = {**(drafter or {"method": "mtp"}), "num_speculative_tokens": k}
    replicated = {**spec, "attention_backend": REPLICATED_DRAFT_BACKEND[attention_kind]}
    piecewise = {"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128]}
    rows: list[tuple[str, dict[str, Any]]] = [(f"TP{tp} + greedy fixed K", {"tensor_parallel_size": tp,
                                                                           "speculative_config": spec})]
    for p in pcp_sizes:
        pcp = {"prefill_context_parallel_size": p}
        rows += [
            (f"PCP{p} + greedy fixed K", {**pcp, "speculative_config": spec}),
            (f"PCP{p} + greedy fixed K + PIECEWISE", {**pcp, "speculative_config": spec,
                                                      "compilation_config": piecewise}),
            (f"PCP{p} + probabilistic fixed K", {**pcp, "speculative_config": {
                **spec, "draft_sample_method": "probabilistic"}}),
            (f"PCP{p} + probabilistic dynamic K", {**pcp, "speculative_config": {
                **spec, "draft_sample_method": "probabilistic", "num_speculative_tokens_per_batch_size": DYNAMIC_K}}),
            (f"PCP{p} + greedy fixed K, replicated draft", {**pcp, "speculative_config": replicated}),
        ]
        if drafter is None:
            rows.append((f"PCP{p} + DSpark greedy fixed K", {**pcp, "speculative_config": {
                "method": "dspark", "num_speculative_tokens": k}}))
        # owner-sharded KV (pcp_kv_layout sharded): acceptance must equal the replicated rows above
        rows += [
            (f"PCP{p} sharded KV + greedy fixed K", {**pcp, "pcp_kv_layout": "sharded", "speculative_config": spec}),
            (f"PCP{p} sharded KV + greedy fixed K, replicated draft", {**pcp, "pcp_kv_layout": "sharded",
                                                                       "speculative_config": replicated}),
        ]
    return rows


def format_table(results: list[EvalResult]) -> str:
    reference = next((r for r in results if r.name.startswith("TP") and r.acceptance_rate is not None), None)
    lines = ["| Configuration | Correct | Accuracy | Invalid | Acceptance rate | Acceptance length | "
             "Δ rate vs TP | Δ length vs TP |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.note:
            lines.append(f"| {r.name} | {r.note} | | | | | | |")
            continue
        rate = f"{r.acceptance_rate:.6f}" if r.acceptance_rate is not None else "n/a"
        length = f"{r.acceptance_length:.6f}" if r.acceptance_length is not None else "n/a"
        d_rate = d_len = "—"
        if reference is not None and r is not reference and r.acceptance_rate is not None:
            d_rate = f"{abs(r.acceptance_rate - reference.acceptance_rate):.6f}"  # type: ignore[operator]
            d_len = f"{abs(r.acceptance_length - reference.acceptance_length):.6f}"  # type: ignore[operator]
        lines.append(f"| {r.name} | {r.correct}/{r.total} | {100 * r.accuracy:.4f}% | {r.invalid} | {rate} | "
                     f"{length} | {d_rate} | {d_len} |")
    return "\n".join(lines)


def run_matrix(base: dict[str, Any], questions: list[Problem], shots: list[Problem], max_tokens: int,
               temperature: float, seed: int, k: int, only: list[str] | None = None, tp: int = 2,
               pcp_sizes: tuple[int, ...] = (2,), chat: bool = False) -> list[EvalResult]:
    """Every row of the table, or only the rows named in `only` (an unknown name is an error). The rows draft with
    `base`'s speculative config (method and model; K is `k`) when it has one, else with MTP."""
    from tandem.config import ConfigError, ModelConfig
    from tandem.executor.multiproc import EngineDeadError
    from tandem.models.registry import attention_kind

    given = base.get("speculative_config")
    drafter = {key: given[key] for key in ("method", "model") if key in given} if given else None
    model = base.get("model")
    if model is None:
        from tandem.assets import default_model

        model = default_model()
    kind = attention_kind(ModelConfig.from_path(str(model)).architecture)
    configs = matrix_configs(k, drafter, kind, tp, pcp_sizes)
    unknown = sorted(set(only or ()) - {name for name, _ in configs})
    if unknown:
        raise ValueError(f"--matrix-rows {unknown}: not rows of the table; one of {[n for n, _ in configs]}")
    results = []
    for name, extra in configs:
        if only is not None and name not in only:
            continue
        print(f"=== {name}", file=sys.stderr, flush=True)
        try:
            results.append(run_in_process(name, {**base, **extra}, questions, shots, max_tokens, temperature, seed,
                                          chat))
        except (ConfigError, ValueError, NotImplementedError) as e:
            # a configuration whose pieces have not landed says so in its row instead of ending the run
            results.append(EvalResult(name, note=f"not run: {e}"))
        except EngineDeadError as e:  # a rank killed (out of memory, a signal): the other rows still run
            results.append(EvalResult(name, note=f"failed: {e}"))
        # the table so far: a run of many multi-rank rows takes hours on a small machine, and a kill loses nothing
        print(format_table(results), file=sys.stderr, flush=True)
    return results


def results_json(results: list[EvalResult]) -> str:
    rows = []
    for r in results:
        row = asdict(r)
        row.pop("answers")
        row["accuracy"] = r.accuracy
        rows.append(row)
    return json.dumps(rows, indent=2)
