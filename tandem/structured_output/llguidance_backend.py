"""llguidance (vLLM's `guidance` alternative): JSON schemas, regexes and GBNF/Lark grammars, compiled into one
validated LLMatcher a grammar that each request deep-copies; masks filled in parallel by an LLExecutor.

Differences from xgrammar a client can see: compact JSON (`disable_any_whitespace`) has no space after `:` and `,`;
`structural_tag` (xgrammar's own format) is refused; a JSON schema `{"$ref": "#"}` compiles (to an empty grammar); a
grammar that forces an endless output is refused (xgrammar follows it until max_tokens).
"""

from __future__ import annotations

import threading
from typing import Any, cast

import torch

from tandem.config import StructuredOutputsConfig
from tandem.structured_output.backend import GrammarBackend, Matcher, hf_tokenizer, stop_token_ids
from tandem.structured_output.params import GrammarError, GrammarSpec

MAX_FORCED_BYTES = 4096


class LLGuidanceMatcher:
    """An LLMatcher behind the Matcher protocol. llguidance does not count the EOS it takes once the grammar has
    stopped (`is_stopped()`: only EOS may follow) and enters a sticky error state on a refused token, so tokens are
    offered with `try_consume_tokens` and the EOS is tracked here: terminated means the grammar took its EOS, and
    `counted` whether llguidance's own history holds it (a rollback then undoes one token fewer there)."""

    def __init__(self, matcher: Any, eos_ids: frozenset[int]):
        self._matcher, self._eos_ids = matcher, eos_ids
        self._terminated = self._counted = False

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self._eos_ids and self._matcher.is_stopped():
            self._terminated, self._counted = True, False
            return True
        if self._matcher.try_consume_tokens([token_id]) != 1:
            return False
        if token_id in self._eos_ids:
            self._terminated, self._counted = True, True
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:
            num_tokens -= 0 if self._counted else 1
            self._terminated = False
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._terminated

    @property
    def native(self) -> Any:
        return self._matcher


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, model_folder: str, vocab_size: int, config: StructuredOutputsConfig):
        super().__init__(model_folder, vocab_size, config)
        self._tokenizer: Any = None  # llguidance's LLTokenizer, built on the first compile
        self._eos_ids: frozenset[int] = frozenset()
        self._executor: Any = None
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> Any:
        """A validated LLMatcher at the grammar's start: each request deep-copies it."""
        import llguidance

        tokenizer = self._ll_tokenizer()
        grammar = self._grammar(spec)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if failed:
            raise GrammarError(f"the {spec.kind} grammar is invalid: {_clean(messages[0])}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {spec.kind} grammar is invalid: {_clean(matcher.get_error())}")
        # a grammar whose output is forced on and on (one with no end: `root ::= "a" root`) puts llguidance's matcher
        # in an error state at its first token (its forced-token expansion runs out of items): refused here instead
        if len(matcher.deep_copy().compute_ff_bytes()) > MAX_FORCED_BYTES:
            raise GrammarError(f"the {spec.kind} grammar forces more than {MAX_FORCED_BYTES} characters in a row "
                               "(a grammar with no end?), which the llguidance backend cannot follow; xgrammar can")
        return matcher

    def matcher(self, compiled: Any) -> Matcher:
        return LLGuidanceMatcher(compiled.deep_copy(), self._eos_ids)

    def fill(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        import llguidance.torch as llt

        targets = [(cast(LLGuidanceMatcher, m).native, row) for m, row in zip(matchers, rows, strict=True)]
        if len(targets) == 1:  # one row: no thread hand-off
            llt.fill_next_token_bitmask(targets[0][0], bitmask, targets[0][1])
            return
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=2)
        llt.fill_next_token_bitmask_par(self._executor, targets, bitmask)

    def _grammar(self, spec: GrammarSpec) -> str:
        import llguidance

        defaults = {"whitespace_flexible": not self.config.disable_any_whitespace}
        try:
            if spec.kind in ("json", "json_object"):
                schema = spec.text if spec.kind == "json" else '{"type": "object"}'
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)  # type: ignore[arg-type]
            if spec.kind == "regex":
                return llguidance.grammar_from("regex", spec.text)
            if spec.kind == "grammar":
                return llguidance.grammar_from("grammar", spec.text)
        except ValueError as e:
            raise GrammarError(f"the {spec.kind} grammar is invalid: {_clean(str(e))}") from None
        raise GrammarError(f"structured_outputs.{spec.kind} is not supported by the llguidance backend: serve with "
                           '--structured-outputs-config \'{"backend": "xgrammar"}\' for it')

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                stops = stop_token_ids(self.model_folder)
                self._eos_ids = frozenset(stops)
                self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer(self.model_folder),
                                                               n_vocab=self.vocab_size, eos_token=stops or None)
            return self._tokenizer


def _clean(message: str) -> str:
    """llguidance's multi-line message (error, source excerpt, caret) on one line."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())[:300]
