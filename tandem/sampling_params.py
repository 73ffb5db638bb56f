"""SamplingParams, vLLM-shaped; invalid values raise ValueError naming the field, the value and what is allowed.

Every value here ends up in an int64 or float32 tensor on every rank, so types and ranges are checked at
construction: a bad value fails its own request at submission and can never reach (and kill) a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tandem.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# the server's bound on logprobs / top_logprobs (vLLM's default max_logprobs, OpenAI's top_logprobs bound); offline,
# the engine bounds them by the vocabulary at submission
MAX_LOGPROBS = 20
# choices are built eagerly at submission (one child request each); the server's --max-n is usually lower
MAX_N = 4096


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-n per prompt token (its own logprob always included)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        # child i of a seeded request samples with seed + i, so the last child's seed must fit int64 too
        max_seed = INT64_MAX - (self.n - 1) if _is_int(self.n) and 1 <= self.n <= MAX_N else INT64_MAX
        checks = [
            ("n", 1 <= self.n <= MAX_N, f"an integer from 1 to {MAX_N} (choices per prompt)"),
            ("temperature", self.temperature >= 0, "a finite number >= 0"),
            ("top_p", 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", 0 <= self.top_k <= INT64_MAX, "-1, 0 (disabled) or a positive int64"),
            ("min_p", 0 <= self.min_p <= 1, "a number in [0, 1]"),
            ("seed", self.seed is None or INT64_MIN <= self.seed <= max_seed,
             f"None or an integer in [{INT64_MIN}, {max_seed}] (int64; with n={self.n}, seed + n - 1 must fit)"),
            ("max_tokens", self.max_tokens is None or 1 <= self.max_tokens <= INT64_MAX,
             "None or a positive int64"),
            ("min_tokens", 0 <= self.min_tokens <= INT64_MAX, "an int64 >= 0"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "must be <= max_tokens"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= INT64_MAX, "None or an int64 >= 0"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= INT64_MAX,
             "None or an int64 >= 0"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("stop_token_ids", all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids),
             "non-negative token ids"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {allowed}")

    def _check_types(self) -> None:
        """Types first, so the range checks compare numbers (a str temperature would raise TypeError there)."""
        ints = {"n": False, "top_k": False, "seed": True, "max_tokens": True, "min_tokens": False,
                "logprobs": True, "prompt_logprobs": True}  # name -> None allowed
        for name, optional in ints.items():
            value = getattr(self, name)
            if not (_is_int(value) or (optional and value is None)):
                raise ValueError(f"SamplingParams.{name}={value!r} is invalid: "
                                 f"{'None or ' if optional else ''}an integer")
        for name in ("temperature", "top_p", "min_p"):
            if not _is_real(getattr(self, name)):
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: a finite number")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: True or False")
        if not (self.stop is None or isinstance(self.stop, str | list | tuple)):
            raise ValueError(f"SamplingParams.stop={self.stop!r} is invalid: None, a string or a list of strings")
        if not isinstance(self.structured_outputs, StructuredOutputsParams | None):
            raise ValueError(f"SamplingParams.structured_outputs={self.structured_outputs!r} is invalid: None or a "
                             "StructuredOutputsParams")
        if not isinstance(self.stop_token_ids, list | tuple | None):
            raise ValueError(f"SamplingParams.stop_token_ids={self.stop_token_ids!r} is invalid: a list of ints")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
