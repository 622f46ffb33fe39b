"""What the engine loop tells an operator: a periodic line while it steps, and one line per
finished request.

The periodic line (every ``every_s`` of stepping) gives vLLM's figures, the prompt and
generation throughput, the running and waiting requests, and KV cache usage, and then where
the engine thread's time went: stepping, handing outputs over, and between steps (while it
had work: the waits for a request when it had none are left out). The
request line gives a finished request's reasons, its prompt tokens (cached among them), its
generated tokens and the seconds since it was submitted. Invariants: it only reads the
engine (from the engine thread), and a line costs the thread a few microseconds.
"""

from __future__ import annotations

import logging
import time

from epserve.head.engine import Engine
from epserve.head.sequence import Request

log = logging.getLogger("epserve.head.async_engine")


class LoopLog:
    def __init__(self, every_s: float):
        self.every_s = every_s
        self.submitted: dict[str, float] = {}  # request id -> monotonic time it came in
        self._reset(time.monotonic(), 0, 0)

    def _reset(self, now: float, prompt: int, gen: int) -> None:
        self.since, self.last_end, self.n, self.gaps = now, None, 0, 0
        self.step_s = self.deliver_s = self.outside_s = 0.0
        self.prompt0, self.gen0 = prompt, gen

    def went_idle(self) -> None:
        """The engine ran out of work: the wait for the next request is not time between
        steps (a closed-loop client's round trip between two waves would read as overhead)."""
        self.last_end = None

    def step(self, t0: float, t1: float, t2: float, engine: Engine) -> None:
        """One step that ran ``[t0, t1)`` and handed its outputs over in ``[t1, t2)``."""
        if self.last_end is not None:
            self.outside_s, self.gaps = self.outside_s + t0 - self.last_end, self.gaps + 1
        self.n, self.step_s, self.deliver_s, self.last_end = \
            self.n + 1, self.step_s + t1 - t0, self.deliver_s + t2 - t1, t2
        if t2 - self.since < self.every_s:
            return
        took, st, sched = t2 - self.since, engine.stats, engine.scheduler
        ahead = getattr(engine.model, "lookahead", None)
        hits = f"; decode lookahead {ahead.hits}/{ahead.launched} used" if ahead else ""
        log.info("engine loop: prompt throughput %.1f tokens/s, generation throughput %.1f "
                 "tokens/s, running %d, waiting %d, KV cache usage %.1f%%; %d steps in %.1f s; "
                 "per step %.2f ms stepping, %.2f ms handing outputs over, %.2f ms between "
                 "steps%s", (st.prompt_tokens - self.prompt0) / took,
                 (st.generation_tokens - self.gen0) / took, len(sched.running),
                 len(sched.waiting), 100 * engine.model.kv_cache_usage(), self.n, took,
                 1e3 * self.step_s / self.n, 1e3 * self.deliver_s / self.n,
                 1e3 * self.outside_s / max(self.gaps, 1), hits)
        self._reset(t2, st.prompt_tokens, st.generation_tokens)

    def finished(self, req: Request) -> None:
        since = self.submitted.pop(req.request_id, None)
        took = f" in {time.monotonic() - since:.2f} s" if since is not None else ""
        reasons = ",".join(sorted({s.finish_reason or "error" for s in req.seqs})) or "error"
        log.info("request %s finished (%s): prompt %d tokens (%d cached), %d generated%s",
                 req.request_id, reasons, len(req.prompt_ids), req.num_cached_tokens,
                 sum(len(s.output_ids) for s in req.seqs), took)
