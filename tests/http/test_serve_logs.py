"""What the terminal of `epserve serve` shows while it serves, as vLLM's server shows it: the
engine's line for each finished request and its periodic line (throughput, running, waiting,
KV cache usage), as they happen; none of the Ray Serve actors' chatter; and Ctrl-C still ends
it quietly."""

from __future__ import annotations

import inspect
import re
import time

import pytest
import requests
from serverkit import free_port, wait_for
from test_serve_command import start_serve, stop_serve

# "(HeadActor pid=N) <time> epserve.head.async_engine ..." (head_actor's logging format)
_HEAD = r"^\(HeadActor pid=\d+\) \S+ \S+ epserve\.head\.async_engine "
_PERIODIC = re.compile(_HEAD + r"engine loop: prompt throughput [\d.]+ tokens/s, generation "
                       r"throughput [\d.]+ tokens/s, running \d+, waiting \d+, KV cache usage "
                       r"[\d.]+%", re.M)


def _log_every_s() -> float:
    """The head's periodic interval (AsyncEngine's default, which the head keeps)."""
    from epserve.head.async_engine import AsyncEngine

    return inspect.signature(AsyncEngine).parameters["log_every_s"].default


@pytest.mark.slow
def test_serve_prints_the_engine_lines_live(tmp_path):
    every_s = _log_every_s()
    port = free_port()
    proc = start_serve(tmp_path, "--port", str(port))  # the built-in demo model
    up_at = time.monotonic()
    err = tmp_path / "stderr.log"
    try:
        # the periodic line comes with the first step once every_s has passed since the engine
        # started, which was before the URL was printed
        time.sleep(max(0.0, every_s - (time.monotonic() - up_at)))
        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "model": "epserve-demo", "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        # this request's line (the engine's id is the response's plus a suffix)
        finished = re.compile(
            _HEAD + re.escape(f"request {body['id']}-") + r"\d+ finished \(length\): "
            rf"prompt {body['usage']['prompt_tokens']} tokens \(0 cached\), 4 generated in "
            r"[\d.]+ s$", re.M)
        # while it serves, not only once it stops
        assert wait_for(lambda: finished.search(err.read_text()) and
                        _PERIODIC.search(err.read_text()), timeout_s=20), err.read_text()[-3000:]
    finally:
        rc, said = stop_serve(proc, tmp_path)
    assert rc == 0, said[-3000:]
    assert "graceful_shutdown" not in said and "Traceback" not in said, said[-3000:]
    # Ray Serve's actors (deployments, endpoints, an access line per request) stay in Ray's logs
    assert not re.search(r"\((ServeController|ProxyActor|ServeReplica)", said), said[-3000:]
