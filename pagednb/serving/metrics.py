"""GET /metrics: Prometheus metrics under vLLM's names, in a registry of the server's own.

Each server has its own CollectorRegistry (not prometheus-client's global one), so two servers in one
kernel, or a server started twice, never clash. Engine-wide values are read from `llm.stats()` when
scraped: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (a
fraction in [0, 1], as vLLM's), `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits` (tokens),
`vllm:num_preemptions`. The request metrics count the requests this server served (not the cell's own
`generate` calls): `vllm:prompt_tokens`, `vllm:generation_tokens`, `vllm:request_success` by
finished_reason, and the histograms `vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds` (time per output token after the first) and
`vllm:e2e_request_latency_seconds`. Every family carries the label model_name, as vLLM's.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagednb.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class EngineCollector:
    """The engine's gauges and counters, read from stats() at scrape time."""

    def __init__(self, llm, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name

    def collect(self):
        stats = self.llm.stats()
        families = [
            (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.", stats["running"]),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats["waiting"]),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
             stats["kv_usage"]),
            (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats["prefix_cache_query_tokens"]),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats["prefix_cache_hit_tokens"]),
            (CounterMetricFamily, "vllm:num_preemptions", "Requests preempted (recomputed later).",
             stats["preemptions"]),
        ]
        for family, name, documentation, value in families:
            metric = family(name, documentation, labels=["model_name"])
            metric.add_metric([self.model_name], value)
            yield metric


class ServerMetrics:
    """The server's registry; `observe(final_output)` records a finished request."""

    def __init__(self, llm, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(llm, model_name))
        self.model_name = model_name
        labels = dict(labelnames=["model_name"], registry=self.registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of served requests.", **labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated for served requests.", **labels)
        self.request_success = Counter("vllm:request_success", "Served requests that finished, by finished_reason.",
                                       labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY_BUCKETS,
                              **labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time per output token after the first.",
                             buckets=_LATENCY_BUCKETS, **labels)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", buckets=_LATENCY_BUCKETS,
                             **labels)

    def observe(self, final: RequestOutput, num_generated: int, num_completions: int) -> None:
        """A finished request: its token counts, its finish reason and (when it produced tokens) its latencies."""
        name = self.model_name
        self.prompt_tokens.labels(name).inc(len(final.prompt_token_ids))
        self.generation_tokens.labels(name).inc(num_generated)
        reason = final.outputs[0].finish_reason if final.outputs else "abort"
        self.request_success.labels(name, reason or "abort").inc()
        timing = final.metrics
        if timing is None or timing.first_token_time is None or timing.finished_time is None:
            return
        self.ttft.labels(name).observe(timing.first_token_time - timing.arrival_time)
        self.e2e.labels(name).observe(timing.finished_time - timing.arrival_time)
        per_completion = num_generated / num_completions
        if per_completion > 1:
            self.itl.labels(name).observe((timing.finished_time - timing.first_token_time) / (per_completion - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
