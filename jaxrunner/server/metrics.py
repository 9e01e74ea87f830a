"""The server's Prometheus metrics, vLLM's names under the `jaxrunner:` prefix.

Latencies are observed on the engine's thread as outputs leave a step: time to first token from the
moment the engine took the request, inter-token latency as the gap between a request's outputs
spread over the tokens they brought (a multi-step output carries several). Engine counters
(running, waiting, KV usage, prefix cache, preemptions, drafts) are read from the last step's
snapshot when scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxrunner.engine.outputs import EngineStats, RequestOutput
from jaxrunner.server.async_llm import StepObserver

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUEST_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class ServerMetrics(StepObserver):
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels, r = ["model_name"], self.registry
        self.ttft = Histogram("jaxrunner:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("jaxrunner:inter_token_latency_seconds", "Time between output tokens",
                             labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("jaxrunner:e2e_request_latency_seconds", "Request latency, taken to finished",
                             labels, buckets=REQUEST_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("jaxrunner:prompt_tokens", "Prompt tokens taken", labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("jaxrunner:generation_tokens", "Tokens generated", labels,
                                         registry=r).labels(model_name)
        self.finished = Counter("jaxrunner:request_success", "Requests finished, by finish reason",
                                labels + ["finished_reason"], registry=r)
        self.stats: EngineStats | None = None
        self._requests: dict[str, list[float]] = {}  # request id -> [taken at, last output at, tokens so far]
        r.register(_EngineCollector(self))

    def added(self, request_id: str, num_prompt_tokens: int, now: float) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self._requests[request_id] = [now, now, 0]

    def aborted(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self.finished.labels(self.model_name, "abort").inc()

    def stepped(self, outputs: list[RequestOutput], stats: EngineStats, now: float) -> None:
        self.stats = stats
        for out in outputs:
            if (times := self._requests.get(out.request_id)) is None:
                continue
            tokens = sum(len(c.token_ids) for c in out.outputs)
            if tokens:
                self.generation_tokens.inc(tokens)
                if times[2] == 0:
                    self.ttft.observe(now - times[0])
                else:
                    self.itl.observe((now - times[1]) / tokens)
                times[1], times[2] = now, times[2] + tokens
            if out.finished:
                del self._requests[out.request_id]
                self.e2e.observe(now - times[0])
                for c in out.outputs:
                    self.finished.labels(self.model_name, c.finish_reason or "abort").inc()


class _EngineCollector:
    """The engine's counters from the last step's snapshot."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        stats, name = self.metrics.stats, self.metrics.model_name
        if stats is None:
            return
        gauges = (("num_requests_running", "Requests running", stats.num_running),
                  ("num_requests_waiting", "Requests waiting", stats.num_waiting),
                  ("kv_cache_usage_perc", "Fraction of KV cache blocks held by requests", stats.kv_cache_usage))
        counters = [("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", stats.prefix_cache_queries),
                    ("prefix_cache_hits", "Prompt tokens found in the prefix cache", stats.prefix_cache_hits),
                    ("num_preemptions", "Requests preempted", stats.num_preemptions),
                    ("kv_offload_hits", "Prompt tokens found in the prefix cache's host tier", stats.kv_offload_hits),
                    ("kv_offload_bytes_saved", "KV bytes copied to the host tier", stats.kv_offload_bytes_saved),
                    ("kv_offload_bytes_loaded", "KV bytes copied back from the host tier", stats.kv_offload_bytes_loaded),
                    ("kv_offload_seconds", "Host seconds the host tier's copies took", stats.kv_offload_seconds)]
        if spec := stats.spec_decoding:
            counters += [("spec_decode_num_drafts", "Draft runs", spec["num_drafts"]),
                         ("spec_decode_num_draft_tokens", "Draft tokens proposed", spec["num_draft_tokens"]),
                         ("spec_decode_num_accepted_tokens", "Draft tokens accepted", spec["num_accepted_tokens"])]
        for key, text, value in gauges:
            family = GaugeMetricFamily(f"jaxrunner:{key}", text, labels=["model_name"])
            family.add_metric([name], value)
            yield family
        for key, text, value in counters:
            family = CounterMetricFamily(f"jaxrunner:{key}", text, labels=["model_name"])
            family.add_metric([name], value)
            yield family
