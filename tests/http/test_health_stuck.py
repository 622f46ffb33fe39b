"""/health answers within a second whatever the engine does: with the engine's process frozen
(SIGSTOP, as a process stuck in a collective or a debugger would be) it says 503 in OpenAI's
error shape without waiting, and 200 again once the process runs."""

from __future__ import annotations

import os
import signal
import time

import requests
from serverkit import HEAD_NAME


def _health(server) -> tuple[int, float, dict | None]:
    t0 = time.monotonic()
    r = requests.get(f"{server.base}/health", timeout=10)
    return r.status_code, time.monotonic() - t0, (r.json() if r.content else None)


def test_health_answers_within_a_second_while_the_engine_is_frozen(server):
    import ray

    from epserve.cluster.bringup import NAMESPACE

    head = ray.get_actor(HEAD_NAME, namespace=NAMESPACE)
    pid = ray.get(head.pid.remote())
    assert _health(server)[0] == 200
    os.kill(pid, signal.SIGSTOP)
    try:
        seen = [_health(server) for _ in range(3)]
    finally:
        os.kill(pid, signal.SIGCONT)
    for status, took, body in seen:
        assert status == 503 and took < 1.0, (status, took, body)
        assert body["error"]["code"] == "engine_unavailable" and body["error"]["message"]
    deadline = time.monotonic() + 30
    while _health(server)[0] != 200:
        assert time.monotonic() < deadline, "health did not come back after the freeze"
        time.sleep(0.2)
    r = requests.post(f"{server.v1}/completions", headers=server.auth, timeout=60,
                      json={"model": server.model, "prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200, r.text
