"""Grammar compilation on xgrammar: one compiler per process and model, cached by grammar text, bounded in time.

Compiles run on a small thread pool (xgrammar's C++ releases the GIL), so the server awaits them off its event loop
and the engine never compiles inside a step it has already scheduled: a request is admitted with its grammar ready.
The cache holds futures, so concurrent requests for one grammar share one compile, and a grammar that failed fails
again at once. A compile past `compile_timeout_s` is answered with an error; its thread finishes in the background
(C++ cannot be interrupted), which is why the pool is small and the sizes are bounded first (params.py).
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from tandem.config import EngineConfig, StructuredOutputsConfig
from tandem.structured_output.params import GrammarError, GrammarSpec

MAX_CACHED_GRAMMARS = 512
_ANY_OBJECT = '{"type": "object", "additionalProperties": true}'
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass
class CompileStats:
    num_compiles: int = 0  # grammars compiled (cache misses)
    num_cache_hits: int = 0
    compile_s: float = 0.0  # seconds spent compiling, summed


class GrammarCompiler:
    def __init__(self, model_folder: str, vocab_size: int, config: StructuredOutputsConfig):
        self.model_folder, self.vocab_size = model_folder, vocab_size
        self.config = config
        self.stats = CompileStats()
        self._cache: OrderedDict[GrammarSpec, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tandem-grammar")
        self._compiler: Any = None

    def compile(self, spec: GrammarSpec) -> Any:
        """The xgrammar CompiledGrammar of `spec`; GrammarError when it is invalid or takes too long."""
        with self._lock:
            future = self._cache.get(spec)
            if future is None:
                future = self._pool.submit(self._compile, spec)
                self._cache[spec] = future
                if len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec)
                self.stats.num_cache_hits += 1
        try:
            return future.result(timeout=self.config.compile_timeout_s)
        except FutureTimeout:
            raise GrammarError(f"the {spec.kind} grammar did not compile within {self.config.compile_timeout_s} s "
                               "(structured_outputs_config.compile_timeout_s): simplify it") from None

    def _compile(self, spec: GrammarSpec) -> Any:
        start = time.perf_counter()
        compiler = self._xgrammar_compiler()
        try:
            if spec.kind in ("json", "json_object"):
                # json_object is OpenAI's "a JSON object" (xgrammar's built-in JSON grammar allows arrays too)
                out = compiler.compile_json_schema(spec.text if spec.kind == "json" else _ANY_OBJECT,
                                                   any_whitespace=not self.config.disable_any_whitespace)
            elif spec.kind == "regex":
                out = compiler.compile_regex(spec.text)
            elif spec.kind == "grammar":
                out = compiler.compile_grammar(spec.text)
            else:
                out = compiler.compile_structural_tag(spec.text)
        except (RuntimeError, ValueError, TypeError, RecursionError) as e:
            raise GrammarError(f"the {spec.kind} grammar is invalid: {_clean(e)}") from None
        finally:
            with self._lock:
                self.stats.num_compiles += 1
                self.stats.compile_s += time.perf_counter() - start
        return out

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                from tandem.tokenizer import Tokenizer

                # the grammar's end allows exactly the tokens that end a request (the model's EOS ids)
                stop_token_ids = sorted(Tokenizer(self.model_folder).eos_token_ids)
                tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(self.model_folder) / "tokenizer.json"))
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=stop_token_ids or None)
                # xgrammar keeps its own cache too; ours (of futures) is what bounds and counts
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


def _clean(e: BaseException) -> str:
    """xgrammar's message without its timestamp, C++ file and check expression."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return _NATIVE_PREFIX.sub("", lines[0] if lines else type(e).__name__)[:300]


def grammar_compiler(config: EngineConfig) -> GrammarCompiler:
    """The process's compiler for the engine's model: the engine compiles a request's grammar before admitting it,
    and a model runner in the same process finds it compiled."""
    model = config.model_config
    return _process_compiler(model.model, model.get("vocab_size"), config.structured_outputs_config)


@cache
def _process_compiler(model_folder: str, vocab_size: int, config: StructuredOutputsConfig) -> GrammarCompiler:
    return GrammarCompiler(model_folder, vocab_size, config)
