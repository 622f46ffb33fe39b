"""`epserve serve` (``serve_main``) in a subprocess over a tiny checkpoint that ships no
tokenizer: it prints its URL, serves token-id prompts, refuses text prompts with a clear 400,
shows in its terminal what vLLM's server shows while it serves (the engine's line for each
finished request and its periodic line: throughput, running, waiting, KV cache usage; none of
the Ray Serve actors' chatter), and on Ctrl-C (SIGINT) removes everything and exits 0,
quietly."""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import requests
from serverkit import free_port, wait_for

_MAIN = """
import sys
from epserve.deploy.cli import _parser
from epserve.deploy.server import serve_main
sys.exit(serve_main(_parser().parse_args(sys.argv[1:])))
"""


# "(HeadActor pid=N) <time> epserve.head.async_engine ..." (head_actor's logging format)
_HEAD = r"^\(HeadActor pid=\d+\) \S+ \S+ epserve\.head\.async_engine "
_PERIODIC = re.compile(_HEAD + r"engine loop: prompt throughput [\d.]+ tokens/s, generation "
                       r"throughput [\d.]+ tokens/s, running \d+, waiting \d+, KV cache usage "
                       r"[\d.]+%", re.M)


def _log_every_s() -> float:
    """The head's periodic interval (AsyncEngine's default, which the head keeps)."""
    from epserve.head.async_engine import AsyncEngine

    return inspect.signature(AsyncEngine).parameters["log_every_s"].default


def start_serve(tmp_path, *args: str) -> subprocess.Popen:
    """`epserve serve ARGS` as a user starts it, its stdout and stderr in tmp_path; returned
    once it printed its URL."""
    # what a user gets: no Ray auth settings of ours (epserve serve makes its own token)
    env = {k: v for k, v in os.environ.items() if k not in (
        "RAY_ADDRESS", "EPSERVE_API_KEY", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    with open(tmp_path / "stdout.log", "w") as out, open(tmp_path / "stderr.log", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", _MAIN, "serve", *args],
                                stdout=out, stderr=err, env=env)

    def up():
        assert proc.poll() is None, (tmp_path / "stderr.log").read_text()[-3000:]
        return "/v1 (" in (tmp_path / "stdout.log").read_text()
    try:
        assert wait_for(up, timeout_s=240, every_s=0.2), "never printed its URL"
    except BaseException:
        stop_serve(proc, tmp_path)
        raise
    return proc


def stop_serve(proc: subprocess.Popen, tmp_path) -> tuple[int, str]:
    """Ctrl-C (SIGINT), as a terminal sends it: the exit status and all it printed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait(10)
    return rc, (tmp_path / "stderr.log").read_text() + (tmp_path / "stdout.log").read_text()


@pytest.mark.slow
def test_serve_main_over_a_tokenizer_less_checkpoint(qwen3_ckpt, tmp_path):
    port = free_port()
    proc = start_serve(tmp_path, "--model", str(qwen3_ckpt), "--dtype", "float32",
                       "--port", str(port), "--served-model-name", "tiny",
                       "--max-num-seqs", "8")
    up_at, err = time.monotonic(), tmp_path / "stderr.log"
    base = f"http://127.0.0.1:{port}"
    try:
        r = requests.post(base + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0,
            "logprobs": 1, "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 4
        choice = body["choices"][0]
        assert len(choice["logprobs"]["token_logprobs"]) == 4
        assert len(choice["token_ids"]) == 4 and choice["prompt_token_ids"] == [5, 6, 7]
        r = requests.post(base + "/v1/completions", timeout=60, stream=True, json={
            "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0,
            "return_token_ids": True, "stream": True})
        streamed = [json.loads(line[6:]) for line in r.iter_lines()
                    if line.startswith(b"data: {")]
        assert [t for ch in streamed for t in ch["choices"][0]["token_ids"]] == \
            choice["token_ids"]
        r = requests.post(base + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "text needs a tokenizer", "max_tokens": 4})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "prompt"
        r = requests.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = requests.post(base + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": [[1, 2], [320]], "max_tokens": 2})
        assert r.status_code == 400 and "not a token id" in r.json()["error"]["message"]
        # the periodic line comes with the first step once its interval has passed since the
        # engine started (before the URL was printed); the lines show while it serves
        time.sleep(max(0.0, _log_every_s() - (time.monotonic() - up_at)))
        r = requests.post(base + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": [9, 8, 7, 6], "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        finished = re.compile(  # the engine's id is the response's plus a suffix
            _HEAD + re.escape(f"request {r.json()['id']}-") + r"\d+ finished \(length\): "
            r"prompt 4 tokens \(\d+ cached\), 4 generated in [\d.]+ s$", re.M)
        assert wait_for(lambda: finished.search(err.read_text()) and
                        _PERIODIC.search(err.read_text()), timeout_s=20), err.read_text()[-3000:]
    finally:
        rc, said = stop_serve(proc, tmp_path)
    assert rc == 0, said[-3000:]
    # Ctrl-C ends quietly: no Ray task-failure noise, no traceback
    assert "graceful_shutdown" not in said and "Traceback" not in said, said[-3000:]
    # Ray Serve's actors (deployments, endpoints, an access line per request) stay in Ray's logs
    assert not re.search(r"\((ServeController|ProxyActor|ServeReplica)", said), said[-3000:]
