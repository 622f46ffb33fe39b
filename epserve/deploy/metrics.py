"""Prometheus /metrics with vLLM's metric names: engine gauges/counters and request timings.

Invariants: gauges and counters are read from ``HeadActor.stats()`` at scrape time (the engine
is their single source of truth, so every ingress replica reports the same values);
latency histograms are observed in this ingress from stream timing; every series carries
vLLM V1's ``model_name`` and ``engine`` labels (``engine="0"``: one engine per app, as a vLLM
server without data parallelism), ``vllm:cache_config_info`` included; each ingress owns its
own registry (no global state);
the speculative-decoding counters exist only on a server with a speculative_config, as in vLLM.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Mapping

import prometheus_client
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric,
)

from epserve.head.request_timing import REQUEST_LATENCY_BUCKETS

prometheus_client.disable_created_metrics()  # vLLM's exposition has no *_created series

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, so dashboards built for vLLM read these unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = REQUEST_LATENCY_BUCKETS
#: The engine's histograms (``head.request_timing``), as vLLM documents them.
ENGINE_HISTOGRAMS = {
    "vllm:request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "vllm:request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "vllm:request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "vllm:request_inference_time_seconds": "Histogram of time spent in RUNNING phase for "
                                           "request.",
    "vllm:iteration_tokens_total": "Histogram of number of tokens per engine_step.",
}
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
#: vLLM's token-count buckets (1, 2, 5 times powers of ten up to the context length).
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5))
N_BUCKETS = (1, 2, 5, 10, 20)

#: vLLM's speculative-decoding counters (``EngineSnapshot.spec_decode``): only on a server with a
#: speculative_config, as vLLM registers them only then.
SPEC_DECODE_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "Speculative verify rows run (drafts offered to the model).",
     "num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Tokens proposed by the speculative drafter.",
     "num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Drafted tokens the model accepted.",
     "num_accepted_tokens"))

#: finished_reason label values of vllm:request_success_total (always exported, even at 0).
FINISHED_REASONS = ("stop", "length", "abort", "error")
#: vLLM V1's label set of every per-engine series, and this server's one engine's index.
LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"


class _EngineCollector:
    """Turns the last ``HeadActor.stats()`` dict into metric families at collect time."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: Mapping[str, Any] = {}

    def describe(self) -> Iterable[Metric]:
        return []  # families are made per scrape; nothing to pre-register

    def collect(self) -> Iterable[Metric]:
        s, labels = self.stats, [self.model_name, ENGINE_INDEX]
        gauges = (("vllm:num_requests_running", "Requests in model execution batches.",
                   "num_running"),
                  ("vllm:num_requests_waiting", "Requests waiting to be processed.",
                   "num_waiting"),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                   "kv_usage"))
        for name, doc, key in gauges:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(labels, float(s.get(key, 0)))
            yield g
        counters = (("vllm:prompt_tokens", "Prefill tokens processed.", "prompt_tokens"),
                    ("vllm:generation_tokens", "Generation tokens processed.",
                     "generation_tokens"),
                    ("vllm:num_preemptions", "Cumulative number of preemptions.",
                     "num_preemptions"))
        counters += (("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number "
                      "of queried tokens.", "prefix_cache_queries"),
                     ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of "
                      "cached tokens.", "prefix_cache_hits"))
        for name, doc, key in counters:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(labels, float(s.get(key, 0)))
            yield c
        hists = s.get("histograms") or {}
        for name, doc in ENGINE_HISTOGRAMS.items():
            if name not in hists:
                continue
            bounds, counts, total = hists[name]
            cum, acc = [], 0
            for bound, count in zip([*map(float, bounds), float("inf")], counts):
                acc += count
                cum.append(("+Inf" if bound == float("inf") else repr(bound), acc))
            h = HistogramMetricFamily(name, doc, labels=LABELS)
            h.add_metric(labels, cum, float(total))
            yield h
        finished = dict(s.get("finished") or {})
        c = CounterMetricFamily("vllm:request_success", "Count of successfully processed "
                                "requests (per completion), by finish reason.",
                                labels=[*LABELS, "finished_reason"])
        for reason in sorted(set(FINISHED_REASONS) | set(finished)):
            c.add_metric([*labels, str(reason)], float(finished.get(reason, 0)))
        yield c
        yield from self._spec_decode(s.get("spec_decode"))

    def _spec_decode(self, spec: Mapping[str, Any] | None) -> Iterable[Metric]:
        if spec is None:  # speculation not configured: no series at all
            return
        labels = [self.model_name, ENGINE_INDEX]
        for name, doc, key in SPEC_DECODE_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(labels, float(spec.get(key, 0)))
            yield c
        c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Drafted tokens the model accepted, by position in the draft "
                                "(0 is the first drafted token).",
                                labels=[*LABELS, "position"])
        for pos, n in enumerate(spec.get("accepted_per_pos") or ()):
            c.add_metric([*labels, str(pos)], float(n))
        yield c


class ServerMetrics:
    """The ingress's registry: engine stats (set before each scrape) and latency histograms."""

    def __init__(self, model_name: str, cache_config: Mapping[str, str] | None = None,
                 max_model_len: int | None = None):
        self.model_name = model_name
        self.max_model_len = max_model_len  # a request's max_tokens when it sets none
        self.registry = CollectorRegistry(auto_describe=False)
        if cache_config:
            info_labels = {**cache_config, "engine": ENGINE_INDEX}  # vLLM adds the engine's
            info = prometheus_client.Gauge("vllm:cache_config_info",
                                           "Information of the LLMEngine CacheConfig",
                                           labelnames=sorted(info_labels),
                                           registry=self.registry)
            info.labels(**info_labels).set(1)
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)
        def hist(name: str, text: str, buckets: Any) -> Any:
            return Histogram(name, text, buckets=buckets, labelnames=LABELS,
                             registry=self.registry).labels(model_name, ENGINE_INDEX)

        self.ttft = hist("vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds",
                         "Histogram of time per output token in seconds.", TPOT_BUCKETS)
        self.request_tpot = hist("vllm:request_time_per_output_token_seconds",
                                 "Histogram of time_per_output_token_seconds per request.",
                                 TPOT_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds",
                        "Histogram of end-to-end request latency in seconds.", E2E_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.prompt_tokens = hist("vllm:request_prompt_tokens",
                                  "Number of prefill tokens processed.", TOKEN_BUCKETS)
        self.generation_tokens = hist("vllm:request_generation_tokens",
                                      "Number of generation tokens processed.", TOKEN_BUCKETS)
        self.params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.",
                             N_BUCKETS)
        self.params_max_tokens = hist("vllm:request_params_max_tokens",
                                      "Histogram of the max_tokens request parameter.",
                                      TOKEN_BUCKETS)
        self.max_generation_tokens = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", TOKEN_BUCKETS)

    def render(self, stats: Mapping[str, Any]) -> bytes:
        """The exposition text with engine values from ``stats`` (``HeadActor.stats()``)."""
        self._engine.stats = stats
        return generate_latest(self.registry)

    def timer(self, start: float | None = None,
              params: Mapping[str, Any] | None = None) -> "RequestTimer":
        """A timer for one engine request that arrived at ``start`` (time.monotonic()) with
        these sampling ``params`` (``n``, ``max_tokens``)."""
        return RequestTimer(self, time.monotonic() if start is None else start, params or {})


class RequestTimer:
    """Timing of one engine request, from its arrival at the ingress to its last token:
    TTFT once, one TPOT per output that brought tokens after the first (the gap divided by
    the tokens it brought), e2e once when the request finishes, and then vLLM V1's per-request
    TPOT: the time from the first token to the last over the tokens after the first (0 for
    one token); and vLLM's request parameter histograms: ``n`` and the largest choice's
    token count once, ``max_tokens`` once per choice (vLLM's: per child request; the context
    left after the prompt when the request set none)."""

    def __init__(self, metrics: ServerMetrics, start: float,
                 params: Mapping[str, Any] | None = None):
        params = params or {}
        self.n, self.max_tokens = int(params.get("n") or 1), params.get("max_tokens")
        self.metrics = metrics
        self.start = self.last = self.first = start
        self.tokens = 0
        self.done = False

    def on_output(self, out: Any) -> None:
        """Called with each cumulative ``RequestOutput`` as it arrives."""
        if self.done:
            return
        now = time.monotonic()
        total = sum(len(c.token_ids) for c in out.outputs)
        new = total - self.tokens
        if new > 0:
            if self.tokens == 0:
                self.metrics.ttft.observe(now - self.start)
                self.first = now
            else:
                self.metrics.tpot.observe((now - self.last) / new)
                self.metrics.itl.observe(now - self.last)
            self.tokens, self.last = total, now
        if out.finished:
            self.done = True
            self.metrics.e2e.observe(now - self.start)
            self.metrics.request_tpot.observe(
                (self.last - self.first) / (total - 1) if total > 1 else 0.0)
            self.metrics.prompt_tokens.observe(len(out.prompt_token_ids))
            self.metrics.generation_tokens.observe(total)
            self._observe_params(out)

    def _observe_params(self, out: Any) -> None:
        m = self.metrics
        m.params_n.observe(self.n)
        m.max_generation_tokens.observe(max((len(c.token_ids) for c in out.outputs), default=0))
        cap = self.max_tokens
        if cap is None and m.max_model_len is not None:
            cap = m.max_model_len - len(out.prompt_token_ids)
        if cap is not None:
            for _ in out.outputs:
                m.params_max_tokens.observe(cap)
