"""GSM8K in the common few-shot layout, plus a synthetic grade-school split in GSM8K's answer format.
Scope: loading, the synthetic generator, prompt layout and answer extraction shared by training and `tandem eval`.

Layout (as lm-eval-harness's gsm8k task and the seed's validation use it):
    Question: <q>\\nAnswer: <reasoning with <<a+b=c>> calculator annotations>\\n#### <N>\\n\\n   (one per shot)
    Question: <q>\\nAnswer:
The model continues after "Answer:"; generation stops at a blank line or at the next "Question:".
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SHARED_GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"
STOP_STRINGS = ["\n\n", "Question:"]
_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # the full worked solution ending in "#### N"

    @property
    def target(self) -> str:
        value = extract_answer(self.answer)
        assert value is not None, self.answer
        return value


def load_jsonl(path: str | Path) -> list[Problem]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K data file {str(path)!r} does not exist")
    problems = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "question" not in row or "answer" not in row:
            raise ValueError(f"{path}:{n}: a GSM8K row needs 'question' and 'answer' keys, got {sorted(row)}")
        problems.append(Problem(row["question"], row["answer"]))
    return problems


def normalize_number(text: str) -> str:
    text = text.replace(",", "").rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value == int(value) else str(value)


def extract_answer(completion: str) -> str | None:
    """`#### N` if present, else the last number in the text, else None (an invalid answer)."""
    m = _ANSWER.search(completion)
    if m is not None:
        return normalize_number(m.group(1))
    numbers = _NUMBER.findall(completion)
    return normalize_number(numbers[-1]) if numbers else None


def format_example(p: Problem) -> str:
    return f"Question: {p.question}\nAnswer: {p.answer}\n\n"


def few_shot_prompt(shots: list[Problem], question: str) -> str:
    return "".join(format_example(s) for s in shots) + f"Question: {question}\nAnswer:"


# ------------------------------------------------------------------------------------------------------
# Synthetic grade-school arithmetic: one- and two-step problems with small numbers, GSM8K's answer format.
# ------------------------------------------------------------------------------------------------------

_NAMES = ["Ava", "Ben", "Carla", "Dev", "Ella", "Finn", "Gia", "Hugo", "Iris", "Jon", "Kai", "Lena", "Mia",
          "Noah", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Vic", "Wes", "Yara", "Zoe"]
_ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "shells", "cards", "eggs", "stamps",
          "flowers", "coins", "balloons", "toy cars", "buttons"]


def _one_problem(rng: random.Random) -> Problem:
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    kind = rng.randrange(6)
    a = rng.randint(2, 60)
    if kind == 0:  # a + b
        b = rng.randint(2, 40)
        q = f"{name} has {a} {item}. {other} gives {name} {b} more {item}. How many {item} does {name} have now?"
        ans = f"{name} has {a}+{b} = <<{a}+{b}={a + b}>>{a + b} {item} now.\n#### {a + b}"
    elif kind == 1:  # a - b
        b = rng.randint(1, a - 1)
        q = f"{name} had {a} {item} and gave {b} of them to {other}. How many {item} does {name} have left?"
        ans = f"{name} has {a}-{b} = <<{a}-{b}={a - b}>>{a - b} {item} left.\n#### {a - b}"
    elif kind == 2:  # a * b
        a, b = rng.randint(2, 12), rng.randint(2, 9)
        q = f"{name} buys {a} bags of {item}. Each bag has {b} {item}. How many {item} does {name} buy?"
        ans = f"{name} buys {a}*{b} = <<{a}*{b}={a * b}>>{a * b} {item}.\n#### {a * b}"
    elif kind == 3:  # (a * b) / b
        b, c = rng.randint(2, 9), rng.randint(2, 12)
        total = b * c
        q = f"{name} shares {total} {item} equally among {b} friends. How many {item} does each friend get?"
        ans = f"Each friend gets {total}/{b} = <<{total}/{b}={c}>>{c} {item}.\n#### {c}"
    elif kind == 4:  # a + b - c
        b = rng.randint(2, 40)
        c = rng.randint(1, a + b - 1)
        q = (f"{name} has {a} {item}. {name} finds {b} more, then gives {c} to {other}. "
             f"How many {item} does {name} have now?")
        ans = (f"After finding more, {name} has {a}+{b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n"
               f"After giving some away, {name} has {a + b}-{c} = <<{a + b}-{c}={a + b - c}>>{a + b - c} {item}.\n"
               f"#### {a + b - c}")
    else:  # a * b + c
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 30)
        q = (f"{name} has {a} boxes with {b} {item} in each box and {c} loose {item}. "
             f"How many {item} does {name} have in all?")
        ans = (f"The boxes hold {a}*{b} = <<{a}*{b}={a * b}>>{a * b} {item}.\n"
               f"In all {name} has {a * b}+{c} = <<{a * b}+{c}={a * b + c}>>{a * b + c} {item}.\n"
               f"#### {a * b + c}")
    return Problem(q, ans)


def arithmetic_drill(rng: random.Random) -> Problem:
    """A one-line calculator problem: the arithmetic of the synthetic problems without their words, so a short
    training phase spends its tokens on the facts the small model gets wrong."""
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        expr, value = f"{a}+{b}", a + b
    elif kind == 1:
        a = rng.randint(3, 100)
        b = rng.randint(1, a - 1)
        expr, value = f"{a}-{b}", a - b
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 9)
        expr, value = f"{a}*{b}", a * b
    return Problem(f"What is {expr}?", f"{expr} = <<{expr}={value}>>{value}\n#### {value}")


# Seeds of the named synthetic splits; training draws from its own stream, so no split leaks into another.
SYNTHETIC_SEEDS = {"train": 1, "test": 2, "shots": 3}


def synthetic_split(name: str, n: int) -> list[Problem]:
    if name not in SYNTHETIC_SEEDS:
        raise ValueError(f"synthetic split {name!r} is not one of {sorted(SYNTHETIC_SEEDS)}")
    rng = random.Random(SYNTHETIC_SEEDS[name])
    return [_one_problem(rng) for _ in range(n)]


def synthetic_stream(seed: int) -> Iterator[Problem]:
    rng = random.Random(1_000 + seed)
    while True:
        yield _one_problem(rng)
