"""Self-distillation data: the target's own greedy answers (tandem's engine) to GSM8K questions and to "Magpie"
requests the target writes itself from its chat template's bare user-turn prefix.
Scope: prompt rendering, the two generation passes, and OUT/data/*.jsonl written chunk by chunk (a rerun skips
finished chunks). Each row: {"ids": prompt + response token ids, "response_start": len(prompt), "source": ...}.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.data.gsm8k import load_jsonl

SENTINEL = "\x00TANDEM-USER-REQUEST\x00"
CHUNK_PROMPTS = 256
MAGPIE_MAX_TOKENS = 64
MAGPIE_OVERSAMPLE = 1.4  # some sampled requests are empty or truncated
# sampling seeds a Magpie chunk may use per prompt slot: chunk c draws seeds from STRIDE * c on, so chunks (and runs
# with another --prompt-offset) never share a seed, which would write the same request twice
MAGPIE_SEED_STRIDE = 2
assert int(CHUNK_PROMPTS * MAGPIE_OVERSAMPLE) + 1 <= MAGPIE_SEED_STRIDE * CHUNK_PROMPTS


@dataclass(frozen=True)
class DistillPlan:
    target: Path
    out: Path
    gsm8k_path: Path
    num_prompts: int
    magpie_share: float
    max_tokens: int
    seed: int
    dtype: str = "float32"
    prompt_offset: int = 0  # where in the seed's GSM8K order, and in its Magpie seeds, this run starts
    exclude: tuple[Path, ...] = ()  # earlier work folders: GSM8K questions answered in their data/ are skipped
    renumber: bool = False  # each GSM8K question's numbers redrawn (seeded): new questions in GSM8K's style


def user_turn_prefix(tokenizer: Any) -> str:
    """The rendered text up to and including the user turn's opening (for SmolLM2: system turn +
    '<|im_start|>user\\n'), cut from a conversation whose user message is a sentinel."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    if SENTINEL not in text:
        raise ValueError("the chat template does not render the user message verbatim; cannot derive its prefix")
    return text[:text.index(SENTINEL)]


def chat_ids(tokenizer: Any, request: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": request}], tokenize=False,
                                         add_generation_prompt=True)
    # the template already holds every special token; the tokenizer must not add a BOS of its own
    return tokenizer.encode(text, add_special_tokens=False)


class Distiller:
    """Writes OUT/data/{gsm8k,magpie}_NNNNN.jsonl; the engine starts only when a chunk is missing."""

    def __init__(self, plan: DistillPlan):
        from transformers import AutoTokenizer

        self.plan = plan
        self.tokenizer = AutoTokenizer.from_pretrained(str(plan.target))
        self.data_dir = plan.out / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._llm: Any = None

    @property
    def llm(self) -> Any:
        if self._llm is None:
            from tandem import LLM

            # 256 rows: 1.13x 64's tokens/s in bfloat16 on a 2-core AMX machine (SmolLM2, 256 GSM8K answers)
            self._llm = LLM(model=str(self.plan.target), dtype=self.plan.dtype, max_num_seqs=256,
                            max_num_batched_tokens=4096)
        return self._llm

    def run(self) -> list[Path]:
        num_magpie = round(self.plan.num_prompts * self.plan.magpie_share)
        questions = [p.question for p in load_jsonl(self.plan.gsm8k_path)]
        random.Random(self.plan.seed).shuffle(questions)
        questions = questions[self.plan.prompt_offset:]
        if self.plan.renumber:
            rng = random.Random(self.plan.seed * 7919 + self.plan.prompt_offset)
            questions = [renumber(q, rng) for q in questions]
        if self.plan.exclude:
            # a later stage learns most from questions no earlier stage answered (distinct answers, not repeats)
            seen = self._answered_prompts(self.plan.exclude)
            questions = [q for q in questions if tuple(chat_ids(self.tokenizer, q)) not in seen]
        gsm8k = questions[:self.plan.num_prompts - num_magpie]
        jobs = [(f"gsm8k_{c // CHUNK_PROMPTS:05d}", lambda c=c: gsm8k[c:c + CHUNK_PROMPTS])
                for c in range(0, len(gsm8k), CHUNK_PROMPTS)]
        magpie = [(f"magpie_{c // CHUNK_PROMPTS:05d}",
                   lambda c=c: self._magpie_requests(
                       self.plan.seed * 1_000_003 + MAGPIE_SEED_STRIDE * (self.plan.prompt_offset + c),
                       min(CHUNK_PROMPTS, num_magpie - c)))
                  for c in range(0, num_magpie, CHUNK_PROMPTS)]
        # generated alternately, so a run stopped part-way leaves both kinds in proportion; listed by kind
        for i in range(max(len(jobs), len(magpie))):
            for name, requests in (jobs[i:i + 1] + magpie[i:i + 1]):
                self._chunk(name, requests)
        paths = [self.data_dir / f"{name}.jsonl" for name, _ in jobs + magpie]
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        return paths

    @staticmethod
    def _answered_prompts(work_dirs: tuple[Path, ...]) -> set[tuple[int, ...]]:
        """The prompt token ids of every GSM8K row in the work folders' data/ chunks."""
        seen: set[tuple[int, ...]] = set()
        for work in work_dirs:
            if not (work / "data").is_dir():
                raise ValueError(f"--exclude-data {work}: no data/ folder there (a `tandem train draft-head` work "
                                 "folder holds one)")
            for row in read_rows(sorted((work / "data").glob("gsm8k_*.jsonl"))):
                seen.add(tuple(row["ids"][:row["response_start"]]))
        return seen

    def _chunk(self, name: str, requests: Any) -> Path:
        path = self.data_dir / f"{name}.jsonl"
        if path.is_file():
            return path
        from tandem import SamplingParams

        prompts = [{"prompt_token_ids": chat_ids(self.tokenizer, r)} for r in requests()]
        outs = self.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=self.plan.max_tokens),
                                 use_tqdm=True) if prompts else []
        rows = [{"ids": list(o.prompt_token_ids) + list(o.outputs[0].token_ids),
                 "response_start": len(o.prompt_token_ids), "source": name.split("_")[0],
                 "finish_reason": o.outputs[0].finish_reason} for o in outs if o.outputs[0].token_ids]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.rename(path)  # a chunk exists whole or not at all
        return path

    def _magpie_requests(self, seed: int, n: int) -> list[str]:
        from tandem import SamplingParams

        prefix_ids = self.tokenizer.encode(user_turn_prefix(self.tokenizer), add_special_tokens=False)
        num = int(n * MAGPIE_OVERSAMPLE) + 1
        params = [SamplingParams(temperature=0.9, top_p=0.95, seed=seed + i, max_tokens=MAGPIE_MAX_TOKENS)
                  for i in range(num)]
        outs = self.llm.generate([{"prompt_token_ids": prefix_ids}] * num, params, use_tqdm=True)
        kept: list[str] = []
        for o in outs:
            text = o.outputs[0].text.strip()
            # "stop" = the end-of-turn token closed the request; "length" = cut off mid-request
            if o.outputs[0].finish_reason == "stop" and len(text) >= 8 and text not in kept:
                kept.append(text)
        return kept[:n]


_NUMBER = re.compile(r"\d+")


def renumber(question: str, rng: random.Random) -> str:
    """The question with every run of digits redrawn to a number of as many digits (no leading zero; "0" stays),
    one draw per distinct run, so a quantity named twice stays the same. GSM8K train holds 7,473 questions; a
    stage past them learns from the target's answers to the same problems over new quantities (its arithmetic
    tokens are most of what a head mispredicts), not from repeats of answers it has seen."""
    drawn: dict[str, str] = {}

    def draw(m: re.Match[str]) -> str:
        digits = m.group()
        if digits not in drawn:
            n = len(digits)
            drawn[digits] = "0" if digits == "0" else str(rng.randint(10 ** (n - 1) if n > 1 else 1, 10 ** n - 1))
        return drawn[digits]

    return _NUMBER.sub(draw, question)


def read_rows(paths: list[Path]) -> list[dict[str, Any]]:
    rows = []
    for path in paths:
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows
