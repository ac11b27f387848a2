"""Prometheus metrics of the generation engine (``GET /metrics``, text exposition format).

Names follow vLLM's (``vllm:`` becomes ``jaxprm:``) so existing dashboards and RL tooling can read
them. Each engine has its own registry (several servers may live in one process).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["EngineMetrics", "CONTENT_TYPE_LATEST"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0, 600.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class EngineMetrics:
    """Counters, gauges and histograms of one engine, in their own ``CollectorRegistry``."""

    def __init__(self, model_name: str = "jaxprm"):
        r = self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("jaxprm:num_requests_running", "Sequences in the running batch (prefill or decode).")
        self.waiting = gauge("jaxprm:num_requests_waiting", "Sequences waiting for admission.")
        self.paused = gauge("jaxprm:paused", "1 while generation is paused (/pause_generation).")
        self.kv_usage = gauge("jaxprm:kv_cache_usage_perc", "Fraction of KV blocks referenced by sequences (0-1).")
        self.kv_cached_blocks = gauge("jaxprm:prefix_cache_blocks", "KV blocks held by the prefix cache.")
        self.weight_version = gauge("jaxprm:weight_version", "Weight version being served.")
        self.compilations = gauge("jaxprm:num_compilations", "Engine programs compiled so far.")
        self.prompt_tokens = counter("jaxprm:prompt_tokens", "Prompt tokens of admitted sequences.")
        self.generation_tokens = counter("jaxprm:generation_tokens", "Generated tokens.")
        self.prefill_tokens = counter("jaxprm:prefill_tokens", "Prompt tokens computed by prefill (not cached).")
        self.cache_queries = counter("jaxprm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = counter("jaxprm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.tool_calls = counter("jaxprm:tool_calls", "Tool calls parsed out of chat answers.")
        self.tool_call_parse_failures = counter("jaxprm:tool_call_parse_failures",
                                                "Chat answers with tool-call markup that did not parse (sent as content).")
        self.preemptions = counter("jaxprm:num_preemptions", "Sequences preempted for lack of KV memory.")
        self.finished = Counter("jaxprm:request_success", "Finished sequences by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.batch_size = hist("jaxprm:decode_batch_size", "Sequences per decode call.", _BATCH_BUCKETS)
        self.iteration_tokens = hist("jaxprm:iteration_tokens_total", "Tokens (prefill + decode) per engine iteration.",
                                     (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096))
        self.ttft = hist("jaxprm:time_to_first_token_seconds", "Time from arrival to the first generated token.",
                         _LATENCY_BUCKETS)
        self.e2e = hist("jaxprm:e2e_request_latency_seconds", "Time from arrival to the last token of a sequence.",
                        _LATENCY_BUCKETS)
        self.queue_time = hist("jaxprm:request_queue_time_seconds", "Time from arrival to first admission.",
                               _LATENCY_BUCKETS)

    def finish(self, reason: str) -> None:
        self.finished.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
