"""Named counters and gauges (prefix `tandem:`), vLLM's Metric shapes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Counter:
    name: str
    value: float


@dataclass(frozen=True)
class Gauge:
    name: str
    value: float


@dataclass(frozen=True)
class Vector:
    """One value per index (`label` names the index in /metrics); a counter or a gauge per value (`kind`)."""

    name: str
    values: list[float]
    label: str = "position"
    kind: str = "counter"


Metric = Counter | Gauge | Vector


@dataclass
class EngineStats:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_requests_finished: int = 0
    num_requests_failed: int = 0
    pcp_gathered_bytes: int = 0
    num_structured_requests: int = 0  # requests whose output a grammar constrains
    grammar_s: float = 0.0  # rank 0's seconds on grammar masks and matchers
