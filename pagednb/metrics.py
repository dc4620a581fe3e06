"""`llm.get_metrics()`: the engine's counters and gauges as a list of named values, vLLM's shape.

vLLM returns `vllm.v1.metrics.reader` objects (Counter, Gauge, Histogram, Vector), each with `name`,
`labels` and `value`. pagednb has counters and gauges only, named `pagednb:<stats() key>` (e.g.
`pagednb:running`, `pagednb:prefix_cache_hit_tokens`), built from `stats()` at the moment of the call.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# stats() keys that only ever grow: counters; every other key is a gauge (a value at this moment)
COUNTER_KEYS = frozenset({"preemptions", "prefix_cache_hit_tokens", "prefix_cache_query_tokens", "steps",
                          "generated_tokens", "computed_tokens", "spec_decode_num_drafts",
                          "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"})


@dataclass(frozen=True)
class Metric:
    name: str
    value: int | float
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Counter(Metric):
    """A total since the engine started."""


@dataclass(frozen=True)
class Gauge(Metric):
    """A value at this moment (blocks free, requests running, ...)."""


def metrics_from_stats(stats: dict, labels: dict[str, str]) -> list[Metric]:
    """Counters and gauges for every numeric stats() entry, in its order."""
    return [(Counter if key in COUNTER_KEYS else Gauge)(f"pagednb:{key}", value, dict(labels))
            for key, value in stats.items() if isinstance(value, (int, float)) and not isinstance(value, bool)]
