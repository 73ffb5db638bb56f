"""xgrammar (the default backend): JSON schemas, regexes, its GBNF dialect and its structural tags, compiled into a
CompiledGrammar; xgrammar's own GrammarMatcher is the per-request matcher, filled in one batched call."""

from __future__ import annotations

import re
import threading
from typing import Any

import torch

from tandem.config import StructuredOutputsConfig
from tandem.structured_output.backend import GrammarBackend, Matcher, hf_tokenizer, stop_token_ids
from tandem.structured_output.params import GrammarError, GrammarSpec

_ANY_OBJECT = '{"type": "object", "additionalProperties": true}'
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class XGrammarBackend(GrammarBackend):
    def __init__(self, model_folder: str, vocab_size: int, config: StructuredOutputsConfig):
        super().__init__(model_folder, vocab_size, config)
        self._compiler: Any = None  # xgrammar's GrammarCompiler, built on the first compile
        self._batch_matcher: Any = None
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> Any:
        compiler = self._xgrammar_compiler()
        try:
            if spec.kind in ("json", "json_object"):
                # json_object is OpenAI's "a JSON object" (xgrammar's built-in JSON grammar allows arrays too)
                return compiler.compile_json_schema(spec.text if spec.kind == "json" else _ANY_OBJECT,
                                                    any_whitespace=not self.config.disable_any_whitespace)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            if spec.kind == "grammar":
                return compiler.compile_grammar(spec.text)
            return compiler.compile_structural_tag(spec.text)
        except (RuntimeError, ValueError, TypeError, RecursionError) as e:
            raise GrammarError(f"the {spec.kind} grammar is invalid: {_clean(e)}") from None

    def matcher(self, compiled: Any) -> Matcher:
        import xgrammar as xgr

        matcher: Matcher = xgr.GrammarMatcher(compiled)
        return matcher

    def fill(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        if len(matchers) == 1:  # one row: the batched fill's thread hand-off costs more than it saves
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])  # type: ignore[attr-defined]
            return
        if self._batch_matcher is None:
            import xgrammar as xgr

            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=2)
        self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                stops = stop_token_ids(self.model_folder)
                info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer(self.model_folder), vocab_size=self.vocab_size,
                                                          stop_token_ids=stops or None)
                # xgrammar keeps its own cache too; compiler.py's (of futures) is what bounds and counts
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


def _clean(e: BaseException) -> str:
    """xgrammar's message without its timestamp, C++ file and check expression."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return _NATIVE_PREFIX.sub("", lines[0] if lines else type(e).__name__)[:300]
