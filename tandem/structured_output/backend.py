"""The grammar-engine interface (`structured_outputs_config.backend`): compile a GrammarSpec, make a per-request
matcher from it, fill token bitmasks. One class a backend, one registry; compiler.py caches and bounds compiles,
grammar_masks.py drives the matchers, neither knows which engine runs.

Every backend writes the same bitmask layout: int32 rows of ceil(V / 32) words, bit t % 32 of word t // 32 set when
token t is allowed; one kernel applies it (grammar_masks.py). A grammar's end allows exactly the model's EOS ids.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tandem.config import StructuredOutputsConfig
from tandem.structured_output.params import GrammarSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


class Matcher(Protocol):
    """One request's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by `token_id`; False (and no change) when the grammar refuses it."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        ...

    def is_terminated(self) -> bool:
        """The grammar has ended and taken its EOS: no token is accepted any more."""
        ...


class GrammarBackend(ABC):
    """A grammar engine for one model's tokenizer. `compile` runs on compiler.py's worker threads and raises
    GrammarError for a grammar it cannot follow; its result is cached and shared by every request of that text."""

    def __init__(self, model_folder: str, vocab_size: int, config: StructuredOutputsConfig):
        self.model_folder, self.vocab_size, self.config = model_folder, vocab_size, config

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any: ...

    @abstractmethod
    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of `compiled`."""

    @abstractmethod
    def fill(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Write matcher i's next-token mask into `bitmask[rows[i]]` ([T, ceil(V / 32)] int32 on the CPU); other
        rows are left as they are."""


def make_backend(model_folder: str, vocab_size: int, config: StructuredOutputsConfig) -> GrammarBackend:
    if config.backend in ("guidance", "llguidance"):
        from tandem.structured_output.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(model_folder, vocab_size, config)
    from tandem.structured_output.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(model_folder, vocab_size, config)


def stop_token_ids(model_folder: str) -> list[int]:
    """The tokens that end a request (the model's EOS ids): the only ones a finished grammar allows."""
    from tandem.tokenizer import Tokenizer

    return sorted(Tokenizer(model_folder).eos_token_ids)


@cache
def hf_tokenizer(model_folder: str) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(Path(model_folder) / "tokenizer.json"))
