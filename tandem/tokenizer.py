"""Tokenizer of a model folder (tokenizer.json via `tokenizers`) and the model's EOS ids."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


class Tokenizer:
    def __init__(self, folder: str):
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model={folder!r}: tokenizer.json not found (tandem reads fast tokenizers only)")
        self._tok = HFTokenizer.from_file(str(path))
        self.eos_token_ids = self._eos_ids(Path(folder))

    def _eos_ids(self, folder: Path) -> set[int]:
        for source in (_read_json(folder / "generation_config.json"), _read_json(folder / "config.json")):
            eos = source.get("eos_token_id")
            if eos is not None:
                return set(eos) if isinstance(eos, list) else {eos}
        name = _read_json(folder / "tokenizer_config.json").get("eos_token")
        if isinstance(name, dict):
            name = name.get("content")
        token_id = self._tok.token_to_id(name) if isinstance(name, str) else None
        return {token_id} if token_id is not None else set()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)
