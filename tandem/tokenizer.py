"""Tokenizer of a model folder (tokenizer.json via `tokenizers`) and the model's EOS ids."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


@cache
def _byte_level_chars() -> dict[str, int]:
    """The inverse of byte-level BPE's printable alphabet (GPT-2's bytes_to_unicode, from transformers)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of a token (e.g. "Ġhello", "<0xE2>"), as HF's convert_ids_to_tokens."""
        return self._tok.id_to_token(token_id) or ""

    def encode_off_gil(self, text: str) -> list[int]:
        """encode(), through the batch call, which releases the GIL (encode holds it): a long text tokenized on a
        worker thread then leaves the event loop running."""
        return self._tok.encode_batch([text])[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_output(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """A finished request's text: decode(), less the U+FFFD of a trailing unfinished UTF-8 character (a
        generation cut inside a multi-byte character). DecodeStream holds such a tail back, so the streamed pieces
        never carry it, and vLLM's output text (built from the same stream) does not either."""
        return self.decode(token_ids, skip_special_tokens).rstrip("\ufffd")

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[int], str]:
        """An incremental decoder (tokenizers' DecodeStream, O(1) a token): feed one token id, get the text it
        adds ("" while a UTF-8 character or a merge is unfinished)."""
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return lambda token_id: stream.step(self._tok, token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for; a token holding part of a UTF-8 character decodes to U+FFFD,
        so its bytes come from the vocabulary entry instead."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        piece = self._tok.id_to_token(token_id) or ""
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        chars = _byte_level_chars()
        if piece and all(c in chars for c in piece):
            return bytes(chars[c] for c in piece)
        return text.encode()

    def token_text(self, token_id: int) -> str:
        """One token as text for logprobs: its text, or OpenAI's `bytes:\\xNN...` for a partial character, so
        distinct tokens never share a name."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
