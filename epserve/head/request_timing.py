"""Engine-side timing histograms with vLLM's names and buckets, for /metrics.

Owns the ``Histogram`` counts the engine thread keeps (no Prometheus here: the head exports
plain numbers and each ingress renders them) and when each is observed: per finished request,
its time queued (arrival to first scheduled), in prefill (scheduled to first token), in decode
(first token to finish) and in inference (scheduled to finish); per engine step, the tokens it
ran. Invariants: written by the engine thread only; ``export`` is a copy the snapshot keeps.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from epserve.head.sequence import Request

#: vLLM's request latency buckets (seconds) and iteration token buckets.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, then +Inf (not cumulative)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def export(self) -> tuple[tuple[float, ...], tuple[int, ...], float]:
        return self.buckets, tuple(self.counts), self.total


class EngineTimings:
    """The histograms, by their vLLM metric name."""

    def __init__(self) -> None:
        lat = REQUEST_LATENCY_BUCKETS
        self.histograms = {
            "vllm:request_queue_time_seconds": Histogram(lat),
            "vllm:request_prefill_time_seconds": Histogram(lat),
            "vllm:request_decode_time_seconds": Histogram(lat),
            "vllm:request_inference_time_seconds": Histogram(lat),
            "vllm:iteration_tokens_total": Histogram(ITERATION_TOKEN_BUCKETS),
        }

    def step(self, tokens: int) -> None:
        self.histograms["vllm:iteration_tokens_total"].observe(tokens)

    def finished(self, req: Request, now: float) -> None:
        """A request that ended at ``now``: what it spent where (a request never scheduled
        counts only if it waited)."""
        h = self.histograms
        if req.scheduled_s is None:
            return
        h["vllm:request_queue_time_seconds"].observe(req.scheduled_s - req.arrived_s)
        h["vllm:request_inference_time_seconds"].observe(now - req.scheduled_s)
        if req.first_token_s is not None:
            h["vllm:request_prefill_time_seconds"].observe(req.first_token_s - req.scheduled_s)
            h["vllm:request_decode_time_seconds"].observe(now - req.first_token_s)

    def export(self) -> dict[str, tuple[tuple[float, ...], tuple[int, ...], float]]:
        return {name: h.export() for name, h in self.histograms.items()}
