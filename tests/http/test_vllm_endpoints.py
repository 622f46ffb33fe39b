"""vLLM's endpoints beside the OpenAI API, as a vLLM user calls them: /version, /ping (GET and
POST: SageMaker's probe, /health under another name), /load (the engine requests this ingress
has in flight) and /tokenizer_info (the tokenizer's configuration); the key on each but /ping,
which is open as /health is (and as vLLM leaves it)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import requests
from serverkit import API_KEY, HEAD_NAME, remove_side_app, side_app, side_app_base, wait_for

import epserve

NO_TOKENIZER_APP = "epserve-vllm-endpoints-no-tokenizer"
NO_TOKENIZER_HEAD = "epserve-head-vllm-endpoints-no-tokenizer"
NO_TOKENIZER_PREFIX = "/no-tokenizer"


def _error(r: requests.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, r.text
    assert isinstance(err["message"], str) and err["message"]
    return err


# ---------------------------------------------------------------- /version


def test_version_is_the_package_version(server):
    r = requests.get(f"{server.base}/version", headers=server.auth, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == {"version": epserve.__version__}


# ---------------------------------------------------------------- auth of the new paths


@pytest.mark.parametrize("path", ["/version", "/load", "/tokenizer_info"])
def test_the_new_paths_need_the_key(server, path):
    for headers in ({}, {"Authorization": "Bearer nope"}):
        r = requests.get(server.base + path, headers=headers, timeout=30)
        assert _error(r, 401)["code"] == "invalid_api_key"
    assert requests.get(server.base + path, headers=server.auth, timeout=30).status_code == 200


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_is_open_as_health_is(server, method):
    for headers in ({}, {"Authorization": "Bearer nope"}, server.auth):
        r = requests.request(method, f"{server.base}/ping", headers=headers, timeout=30)
        assert r.status_code == 200 and r.content == b"", (r.status_code, r.text[:200])
    # other methods are OpenAI's 405, as on /health
    r = requests.delete(f"{server.base}/ping", timeout=30)
    assert _error(r, 405)


# ---------------------------------------------------------------- /ping when unhealthy


def test_ping_answers_503_as_health_does_while_the_engine_is_frozen(server):
    import ray

    from epserve.cluster.bringup import NAMESPACE

    head = ray.get_actor(HEAD_NAME, namespace=NAMESPACE)
    pid = ray.get(head.pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        seen = [requests.request(m, f"{server.base}{p}", timeout=10)
                for p, m in [("/ping", "GET"), ("/ping", "POST"), ("/health", "GET")]]
    finally:
        os.kill(pid, signal.SIGCONT)
    for r in seen:
        err = _error(r, 503)
        assert err["type"] == "service_unavailable" and err["code"] == "engine_unavailable"
    assert wait_for(lambda: requests.get(f"{server.base}/ping", timeout=10).status_code == 200,
                    timeout_s=30), "/ping did not come back after the freeze"


# ---------------------------------------------------------------- /tokenizer_info


def test_tokenizer_info_is_the_tokenizers_configuration(server, demo_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model_dir))
    r = requests.get(f"{server.base}/tokenizer_info", headers=server.auth, timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["model_max_length"] == tok.model_max_length == 4096
    assert info["chat_template"] == tok.chat_template and "<|im_start|>" in info["chat_template"]
    # special tokens as their text, as vLLM shows them
    assert info["eos_token"] == tok.eos_token == "<|im_end|>"
    assert info["pad_token"] == tok.pad_token
    assert info["added_tokens_decoder"] == {
        str(i): t.content for i, t in tok.added_tokens_decoder.items()}
    assert info["extra_special_tokens"] == ["<|im_start|>", "<|im_end|>"]
    # no paths of this machine's tokenizer files; the rest is plain JSON
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)
    assert json.loads(json.dumps(info)) == info
    again = requests.get(f"{server.base}/tokenizer_info", headers=server.auth, timeout=30)
    assert again.json() == info


def _no_tokenizer_config(getfixture) -> dict:
    return {"model": str(getfixture("qwen3_ckpt")), "dtype": "float32",
            "served_model_name": "tiny", "api_key": API_KEY, "head_name": NO_TOKENIZER_HEAD,
            "max_num_seqs": 4}


side_app("no_tokenizer_app", NO_TOKENIZER_APP, NO_TOKENIZER_PREFIX, _no_tokenizer_config)


@pytest.fixture
def no_tokenizer_app(server, request):
    """A second app on the same Serve proxy: a checkpoint that ships no tokenizer, under a
    route prefix, with its own engine."""
    try:
        yield side_app_base("no_tokenizer_app", server, request.getfixturevalue,
                            "the tokenizer-less app")
    finally:
        remove_side_app("no_tokenizer_app")  # its head is detached: stopped whatever happened


def test_tokenizer_info_of_a_model_without_tokenizer_is_a_clear_400(server, no_tokenizer_app):
    t0 = time.monotonic()
    r = requests.get(f"{no_tokenizer_app}/tokenizer_info", headers=server.auth, timeout=30)
    err = _error(r, 400)
    assert err["type"] == "invalid_request_error"
    assert "no tokenizer" in err["message"] and "--tokenizer" in err["message"]
    assert time.monotonic() - t0 < 10
    # the rest of the app is there: the key is still needed, the other endpoints answer
    assert _error(requests.get(f"{no_tokenizer_app}/tokenizer_info", timeout=30), 401)
    r = requests.get(f"{no_tokenizer_app}/version", headers=server.auth, timeout=30)
    assert r.json() == {"version": epserve.__version__}
    assert requests.post(f"{no_tokenizer_app}/ping", timeout=30).status_code == 200


# ---------------------------------------------------------------- /load (last: it streams)


def _load(server) -> int:
    r = requests.get(f"{server.base}/load", headers=server.auth, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"server_load"} and isinstance(body["server_load"], int)
    return body["server_load"]


class _Stream:
    """A streaming request, its first chunk read: in flight until read to the end or closed.
    (The line iterator is kept: dropping a half-read one closes the connection.)"""

    def __init__(self, server, route: str, body: dict):
        self.r = requests.post(f"{server.v1}/{route}", headers=server.auth, stream=True,
                               timeout=120, json={"model": server.model, "stream": True,
                                                  "temperature": 0, "ignore_eos": True, **body})
        assert self.r.status_code == 200, self.r.text
        self.lines = self.r.iter_lines()
        assert next(line for line in self.lines if line).startswith(b"data: {")

    def rest(self) -> list[bytes]:
        return [line for line in self.lines if line]


def test_load_counts_the_requests_in_flight(server):
    assert wait_for(lambda: _load(server) == 0, timeout_s=30), "load never settled to 0"
    # a request that finishes, one refused by validation and one refused by the key all leave
    # the count where it was
    r = requests.post(f"{server.v1}/completions", headers=server.auth, timeout=60,
                      json={"model": server.model, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = requests.post(f"{server.v1}/completions", headers=server.auth, timeout=60,
                      json={"model": server.model, "prompt": "Hi", "max_tokens": -1})
    assert _error(r, 400)
    assert _error(requests.post(f"{server.v1}/completions", timeout=60, json={}), 401)
    assert _load(server) == 0
    # two streams, on both routes, long enough to be generating while /load is read
    a = _Stream(server, "completions", {"prompt": "Count:", "max_tokens": 300})
    b = _Stream(server, "chat/completions", {
        "messages": [{"role": "user", "content": "Count"}], "max_tokens": 300})
    assert _load(server) == 2
    assert _load(server) == 2, "reading /load is not load itself"
    for s in (a, b):  # read to the end: in flight until the last chunk
        rest = s.rest()
        assert rest[-1] == b"data: [DONE]" and not any(b'"error"' in x for x in rest), rest[-2:]
    assert wait_for(lambda: _load(server) == 0, timeout_s=30), _load(server)
    # a client that leaves mid-stream is no longer load either
    c = _Stream(server, "completions", {"prompt": "Count:", "max_tokens": 2000})
    assert _load(server) == 1
    c.r.close()
    assert wait_for(lambda: _load(server) == 0, timeout_s=30), _load(server)
