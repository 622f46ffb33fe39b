"""Families 3 and 4 of bench/hostile_probe.py: correctness under concurrency, and EP faults.

``concurrency``: 64 greedy streams with distinct prompts beside hostile-but-valid ones (the
most stop strings, n=8 seeded sampling, logprobs=20, echo with prompt logprobs, n=32): every
stream's token ids (``return_token_ids``) against the offline ``LLM`` on the same model and
options, then the same requests without ``stream`` against their streams.

``ep_fault``: ~16 streams in flight when an EP rank is killed (``ray.kill``) or frozen
(SIGSTOP): /health polled every 0.1 s (each answer's latency; when it turned 503 and when 200
again), requests sent during the re-form, and how every stream ended (all tokens / error
event / hang), the completed ones compared with the offline tokens.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from probe_kit import (Answer, Tally, Target, get, post, request_bytes, sse_events,
                       stream_tokens)

C = "/v1/completions"


class Offline:
    """The offline API over the same folder and options as the server's engine (built on
    first use), and a cache of its answers."""

    def __init__(self, model: str):
        self.model = model
        self._llm = None

    def ids(self, prompt: str, **kw: Any) -> dict[int, list[int]]:
        """Token ids per choice index of ``prompt`` under SamplingParams(**kw)."""
        return self.many([prompt], **kw)[0]

    def many(self, prompts: list[str], **kw: Any) -> list[dict[int, list[int]]]:
        from epserve import LLM, SamplingParams

        if self._llm is None:
            self._llm = LLM(model=self.model, dtype="float32", seed=0)
        outs = self._llm.generate(prompts, SamplingParams(**kw))
        return [{c.index: list(c.token_ids) for c in o.outputs} for o in outs]


def _body(prompt: str, stream: bool, **kw: Any) -> dict[str, Any]:
    b = {"prompt": prompt, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
         "stream": stream, **kw}
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keywords of a request body (the offline twin)."""
    keys = ("n", "temperature", "seed", "max_tokens", "stop", "ignore_eos", "logprobs",
            "prompt_logprobs", "top_p", "top_k", "min_p")
    return {k: body[k] for k in keys if k in body}


def answer_ids(ans: Answer, stream: bool) -> tuple[dict[int, list[int]] | None, str]:
    """(token ids per choice, '' or what was wrong with the answer)."""
    if ans.kind != "http" or ans.status != 200:
        return None, ans.short()
    if not stream:
        body = ans.json() or {}
        return {c["index"]: c.get("token_ids") or [] for c in body.get("choices", [])}, ""
    ids, errors, done = stream_tokens(sse_events(ans.body))
    if errors or not done:
        return ids, f"stream ended with {errors[:1] or 'no [DONE]'}"
    return ids, ""


def _compare(tally: Tally, row: str, label: str, body: dict, ans: Answer,
             want: dict[int, list[int]]) -> bool:
    """Count ``ans`` and compare its tokens with ``want``; True when they match."""
    repro = f"POST {C} {json.dumps(body)[:300]}"
    tally.record(row, ans, "2xx", repro)
    ids, problem = answer_ids(ans, body.get("stream", False))
    if ans.kind != "http" or ans.status != 200:
        return False
    if problem:
        tally.mismatch(row, f"{label}: {problem[:80]}", repro, ans.short(300))
        return False
    if ids != want:
        diff = next((k for k in sorted(set(ids) | set(want)) if ids.get(k) != want.get(k)), None)
        tally.mismatch(row, f"{label}: tokens differ from the offline LLM", repro,
                       f"choice {diff}: got {ids.get(diff)} want {want.get(diff)}")
        return False
    return True


def _hostile_valid(t: Target, n_tok: int) -> list[tuple[str, dict]]:
    stops = [f"{i:032d}" for i in range(256)]
    return [("256 stop strings", _body("Stop strings everywhere", True, max_tokens=n_tok,
                                       stop=stops)),
            ("n=8 seeded", _body("Sample me", True, max_tokens=n_tok, n=8, seed=1234,
                                 temperature=0.8)),
            ("logprobs=20", _body("Log my probs", True, max_tokens=n_tok, logprobs=20)),
            ("echo + prompt_logprobs=20", _body("Echo this prompt back", True,
                                                max_tokens=n_tok, logprobs=20, echo=True,
                                                prompt_logprobs=20)),
            ("n=32 seeded", _body("Many choices", True, max_tokens=4, n=32, seed=7,
                                  temperature=1.0, top_k=50))]


def _unread_streams(t: Target, k: int, n_tok: int) -> list[socket.socket]:
    """``k`` streams of ``n_tok`` tokens with 20 logprobs each whose client never reads: the
    server meets a full socket (backpressure) while it serves everyone else."""
    socks = []
    for i in range(k):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(10)
        s.connect((t.host, t.port))
        body = json.dumps(_body(f"Never read {i}", True, max_tokens=n_tok, logprobs=20))
        s.sendall(request_bytes("POST", C, body.encode(), {**t.auth,
                                                            "Content-Type": "application/json"}))
        socks.append(s)
    return socks


def _close_unread(tally: Tally, t: Target, socks: list[socket.socket]) -> None:
    """Drop the unread streams; their requests must stop running."""
    from probe_protocol import _metric

    for s in socks:
        s.close()
    t0, running = time.monotonic(), None
    while time.monotonic() - t0 < 30:
        running = _metric(get(t, "/metrics", 10.0).body, "vllm:num_requests_running")
        if running == 0:
            break
        time.sleep(0.3)
    tally.row("concurrency").tried += len(socks)
    if running != 0:
        tally.mismatch("concurrency", "unread streams still running 30 s after the client "
                       "left", f"{len(socks)} streams never read, then closed",
                       f"running={running}")
    else:
        tally.note("concurrency", f"{len(socks)} unread streams beside them, freed "
                                  f"{time.monotonic() - t0:.1f}s after close")


def concurrency(tally: Tally, t: Target, offline: Offline, quick: bool) -> None:
    row, n, n_tok = "concurrency", 16 if quick else 64, 12
    innocent = [(f"innocent {i}", _body(f"Request {i}: the experts said", True,
                                        max_tokens=n_tok)) for i in range(n)]
    cases = innocent + _hostile_valid(t, n_tok)
    unread = _unread_streams(t, 4 if quick else 8, 400)
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda c: post(t, C, c[1], 180.0), cases))
    took = time.monotonic() - t0
    _close_unread(tally, t, unread)
    want_innocent = offline.many([b["prompt"] for _, b in innocent], temperature=0,
                                 max_tokens=n_tok, ignore_eos=True)
    wants = want_innocent + [offline.ids(b["prompt"], **_sampling(b))
                             for _, b in cases[len(innocent):]]
    ok = sum(_compare(tally, row, label, body, ans, want)
             for (label, body), ans, want in zip(cases, answers, wants))
    tally.note(row, f"{ok}/{len(cases)} streams exact, {len(cases)} at once in {took:.1f}s")
    # the same requests without stream: the same tokens as their streams
    again = innocent[: 4 if quick else 8] + cases[len(innocent):len(innocent) + 2]
    with ThreadPoolExecutor(len(again)) as pool:
        plain = list(pool.map(lambda c: post(t, C, {**c[1], "stream": False,
                                                    "stream_options": None}, 180.0), again))
    same = 0
    for (label, body), ans in zip(again, plain):
        streamed, _ = answer_ids(answers[cases.index((label, body))], True)
        same += _compare(tally, "stream-vs-plain", label, {**body, "stream": False,
                                                           "stream_options": None},
                         ans, streamed or {})
    tally.note("stream-vs-plain", f"{same}/{len(again)} non-stream = stream")


# --------------------------------------------------------------------------- EP faults


class HealthPoller(threading.Thread):
    """GET /health every 0.1 s: (seconds since start, status or None, latency)."""

    def __init__(self, t: Target):
        super().__init__(daemon=True)
        self.t, self.seen, self.stop = t, [], threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop.is_set():
            ans = get(self.t, "/health", 5.0, key=False)
            self.seen.append((time.monotonic() - self.t0, ans.status if ans.kind == "http"
                              else None, ans.elapsed))
            time.sleep(0.1)

    def first(self, after: float, pred) -> float | None:
        return next((at for at, st, _ in self.seen if at >= after and pred(st)), None)


def _start_fault(fault: str, head_name: str, cleanups: list) -> tuple[float, int]:
    """Kill or freeze EP rank 1; (monotonic time of the fault, its pid)."""
    import ray

    head = ray.get_actor(head_name, namespace="epserve")
    victim = ray.get(head.worker_handles.remote(), timeout=10)[0]
    pid = ray.get(victim.pid.remote(), timeout=10)
    if fault == "kill":
        t_fault = time.monotonic()
        ray.kill(victim, no_restart=True)
    else:
        cleanups.append(lambda: _cont(pid))
        t_fault = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
    return t_fault, pid


def _cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _wait_running(t: Target, n: int, timeout_s: float = 30.0) -> None:
    from probe_protocol import _metric

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if (_metric(get(t, "/metrics", 10.0).body, "vllm:num_requests_running") or 0) >= n:
            return
        time.sleep(0.2)


def _late_requests(t: Target, poller: HealthPoller, t_fault: float, k: int,
                   max_tokens: int) -> list[tuple[dict, Answer, float]]:
    """Once /health says 503 (or 6 s after the fault), ``k`` requests: (body, answer, sent at
    seconds after the fault)."""
    start = poller.t0
    while time.monotonic() - t_fault < 6.0 and poller.first(t_fault - start, lambda s: s != 200) \
            is None:
        time.sleep(0.05)
    sent = time.monotonic() - t_fault
    bodies = [_body(f"Late request {i}", False, max_tokens=max_tokens) for i in range(k)]
    with ThreadPoolExecutor(k) as pool:
        answers = list(pool.map(lambda b: post(t, C, b, 180.0), bodies))
    return [(b, a, sent) for b, a in zip(bodies, answers)]


def _timed_post(t: Target, body: dict, deadline_s: float) -> tuple[Answer, float]:
    ans = post(t, C, body, deadline_s)
    return ans, time.monotonic()


def ep_fault(tally: Tally, t: Target, offline: Offline, fault: str, head_name: str,
             quick: bool, cleanups: list) -> None:
    row, (n, n_tok) = f"ep-{fault}", ((8, 120) if quick else (16, 160))
    bodies = [_body(f"Fault {fault} stream {i}: once upon a time", True, max_tokens=n_tok)
              for i in range(n)]
    poller = HealthPoller(t)
    poller.start()
    with ThreadPoolExecutor(n) as pool:
        futs = [pool.submit(_timed_post, t, b, 150.0) for b in bodies]
        _wait_running(t, n)
        time.sleep(1.0)  # tokens are flowing
        t_fault, pid = _start_fault(fault, head_name, cleanups)
        late = _late_requests(t, poller, t_fault, 4, 8)
        results = [f.result() for f in futs]
    end = time.monotonic() + 120
    while time.monotonic() < end and poller.first(time.monotonic() - poller.t0 - 0.5,
                                                  lambda s: s == 200) is None:
        time.sleep(0.2)
    poller.stop.set()
    poller.join(10)
    if fault == "sigstop":
        _cont(pid)
    _fault_health(tally, row, poller, t_fault)
    wants = offline.many([b["prompt"] for b in bodies], temperature=0, max_tokens=n_tok,
                         ignore_eos=True)
    kinds = {"complete": 0, "error": 0, "hang": 0, "other": 0, "before": 0}
    for body, (ans, ended), want in zip(bodies, results, wants):
        kinds["before"] += ended < t_fault
        ids, problem = answer_ids(ans, True)
        kinds["hang" if ans.kind == "hang" else "error" if problem.startswith("stream ended")
              else "complete" if not problem and ids == want else "other"] += 1
        _compare(tally, row, "in-flight stream", body, ans, want)
    late_ok = sum(_compare(tally, row, f"sent {sent:.1f}s after the fault", b, a, w)
                  for (b, a, sent), w in zip(late, offline.many(
                      [b["prompt"] for b, _, _ in late], temperature=0, max_tokens=8,
                      ignore_eos=True)))
    after = post(t, C, _body("After the fault", False, max_tokens=4), 60.0)
    tally.record(row, after, "2xx", "a completion once /health is 200 again")
    tally.note(row, f"streams: {kinds['complete']}/{n} exact, {kinds['error']} error event, "
                    f"{kinds['hang']} hang, {kinds['other']} other"
                    + (f", {kinds['before']} ended before the fault" if kinds["before"] else "")
                    + f"; late requests {late_ok}/{len(late)} exact"
                    + (f" (sent +{late[0][2]:.1f}s)" if late else ""))


def _fault_health(tally: Tally, row: str, poller: HealthPoller, t_fault: float) -> None:
    rel = t_fault - poller.t0
    t_bad = poller.first(rel, lambda s: s != 200)
    t_good = poller.first(t_bad, lambda s: s == 200) if t_bad is not None else None
    lats = [lat for _, _, lat in poller.seen]
    slow = [(at - rel, st, lat) for at, st, lat in poller.seen if st is None or lat > 1.0]
    if slow:
        tally.mismatch(row, "/health slower than 1 s or unanswered", "GET /health every 0.1 s",
                       f"{len(slow)} of {len(lats)}; first at +{slow[0][0]:.1f}s: "
                       f"status {slow[0][1]}, {slow[0][2]:.2f}s", n=0)
    if t_bad is None or t_bad - rel > 5.0:
        tally.mismatch(row, "/health did not turn 503 within 5 s", "GET /health",
                       f"first non-200 at {None if t_bad is None else round(t_bad - rel, 1)}")
    if t_good is None:
        tally.mismatch(row, "/health never 200 again", "GET /health", "")
    bad = f"+{t_bad - rel:.1f}s" if t_bad is not None else "never"
    good = f"+{t_good - rel:.1f}s" if t_good is not None else "never"
    tally.note(row, f"503 at {bad}, 200 again at {good}, /health max "
                    f"{max(lats) * 1000:.0f}ms over {len(lats)} polls")


def idle(tally: Tally, t: Target, seconds: float) -> None:
    """No requests for ``seconds``: /health must stay 200 (an idle EP group must not lose a
    rank), and the next request must be served at once."""
    poller = HealthPoller(t)
    poller.start()
    time.sleep(seconds)
    poller.stop.set()
    poller.join(10)
    bad = [(round(at, 1), st) for at, st, _ in poller.seen if st != 200]
    tally.row("idle").tried += 1
    if bad:
        tally.mismatch("idle", "/health not 200 while the server was idle",
                       f"no requests for {seconds:g}s, GET /health every 0.1s",
                       f"{len(bad)} non-200 answers, first at +{bad[0][0]}s: {bad[0][1]}")
    ans = post(t, C, _body("After idling", False, max_tokens=4), 120.0)
    tally.record("idle", ans, "2xx", f"a completion after {seconds:g}s idle")
    tally.note("idle", f"{seconds:g}s idle: {len(bad)} non-200 /health of {len(poller.seen)}; "
                       f"next request {ans.elapsed:.1f}s")
