"""The bundled default model (docs/bundled_model.md): a tiny DeepSeek-V3 with one MTP layer and its DSpark
drafter, trained on GSM8K by `python -m tandem.train`. `LLM()` and `tandem generate` with no model use them."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
DEFAULT_MODEL = ASSETS / "tandem-dsv3-tiny"
DEFAULT_DSPARK = ASSETS / "tandem-dsv3-tiny-dspark"


def default_model() -> str | None:
    return str(DEFAULT_MODEL) if (DEFAULT_MODEL / "config.json").is_file() else None
