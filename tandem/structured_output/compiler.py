"""Grammar compilation: one compiler per process, model and backend (backend.py), cached by grammar text, bounded
in time.

Compiles run on a small thread pool (both backends' native code releases the GIL), so the server awaits them off
its event loop and the engine never compiles inside a step it has already scheduled: a request is admitted with its
grammar ready.
The cache holds futures, so concurrent requests for one grammar share one compile, and a grammar that failed fails
again at once. A compile past `compile_timeout_s` is answered with an error; its thread finishes in the background
(C++ cannot be interrupted), which is why the pool is small and the sizes are bounded first (params.py).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import cache
from typing import Any

from tandem.config import EngineConfig, StructuredOutputsConfig
from tandem.structured_output.backend import GrammarBackend, Matcher, make_backend
from tandem.structured_output.params import GrammarError, GrammarSpec

MAX_CACHED_GRAMMARS = 512


@dataclass
class CompileStats:
    num_compiles: int = 0  # grammars compiled (cache misses)
    num_cache_hits: int = 0
    compile_s: float = 0.0  # seconds spent compiling, summed


class GrammarCompiler:
    def __init__(self, model_folder: str, vocab_size: int, config: StructuredOutputsConfig):
        self.config = config
        self.backend: GrammarBackend = make_backend(model_folder, vocab_size, config)
        self.stats = CompileStats()
        self._cache: OrderedDict[GrammarSpec, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tandem-grammar")

    def compile(self, spec: GrammarSpec) -> Any:
        """The backend's compiled grammar of `spec`; GrammarError when it is invalid or takes too long."""
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

    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A fresh matcher for a request constrained by `spec` (compiled, or found in the cache)."""
        return self.backend.matcher(self.compile(spec))

    def _compile(self, spec: GrammarSpec) -> Any:
        start = time.perf_counter()
        try:
            return self.backend.compile(spec)
        finally:
            with self._lock:
                self.stats.num_compiles += 1
                self.stats.compile_s += time.perf_counter() - start


def grammar_compiler(config: EngineConfig) -> GrammarCompiler:
    """The process's compiler for the engine's model: the engine compiles a request's grammar before admitting it,
    and a model runner in the same process finds it compiled."""
    model = config.model_config
    return _process_compiler(model.model, model.get("vocab_size"), config.structured_outputs_config)


@cache
def _process_compiler(model_folder: str, vocab_size: int, config: StructuredOutputsConfig) -> GrammarCompiler:
    return GrammarCompiler(model_folder, vocab_size, config)
