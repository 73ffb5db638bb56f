"""Everyday instructions: 64 short, non-math requests (an email, an explanation, tips, a recipe, a rewrite, ...),
held out to measure a draft head's acceptance off GSM8K. Training must never use them (everyday_instructions.txt).
"""

from __future__ import annotations

from pathlib import Path

EVERYDAY_INSTRUCTIONS = Path(__file__).with_name("everyday_instructions.txt")


def load_everyday(path: str | Path = EVERYDAY_INSTRUCTIONS) -> list[str]:
    """The instructions of `path`, one a line; `#` lines (the file's header) and blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"everyday instructions file {str(path)!r} does not exist")
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]
