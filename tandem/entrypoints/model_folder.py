"""Pre-flight checks of a model folder, before any weight is loaded or any rank starts: config.json is an object
with the sizes every architecture needs, and every *.safetensors file is readable. A broken folder then fails
with a ConfigError naming the file and the field instead of a traceback from deep inside a loader."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.config import ConfigError

# sizes every supported architecture reads from config.json
_REQUIRED_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_SIZES = ("num_key_value_heads", "intermediate_size", "max_position_embeddings", "head_dim")


def check_model_folder(model: str) -> None:
    """Raise ConfigError for a config.json or weight file that cannot work; a missing folder or config.json is
    left to ModelConfig.from_path, which says what MODEL must be."""
    folder = Path(model)
    config_file = folder / "config.json"
    if not config_file.is_file():
        return
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{config_file}: not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_file}: must be a JSON object, got a JSON {type(raw).__name__}")
    for name in _REQUIRED_SIZES + _OPTIONAL_SIZES:
        value = raw.get(name)
        if value is None and name in _OPTIONAL_SIZES:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{config_file}: {name}={value!r} is not allowed: a positive integer")
    for weights in sorted(folder.glob("*.safetensors")):
        _check_safetensors(weights)


def _check_safetensors(path: Path) -> None:
    from safetensors import safe_open

    try:
        # reads the header only; it checks the header against the file's size, so truncation shows here
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as e:  # noqa: BLE001  SafetensorError and OSError alike: name the file
        raise ConfigError(f"{path}: not a readable safetensors file ({e})") from e
