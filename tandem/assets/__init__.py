"""The bundled default model (docs/bundled_model.md): a tiny DeepSeek-V3 with one MTP layer and its DSpark
drafter, trained on GSM8K by `python -m tandem.train`. `LLM()` and `tandem generate` with no model use them.
Beside them, an EAGLE-3 draft head for SmolLM2-135M-Instruct (docs/eagle3.md), trained by `make train-draft-smollm2`."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
DEFAULT_MODEL = ASSETS / "tandem-dsv3-tiny"
DEFAULT_DSPARK = ASSETS / "tandem-dsv3-tiny-dspark"
SMOLLM2_EAGLE3 = ASSETS / "smollm2-135m-instruct-eagle3"


def default_model() -> str | None:
    return str(DEFAULT_MODEL) if (DEFAULT_MODEL / "config.json").is_file() else None
