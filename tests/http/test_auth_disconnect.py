"""API-key auth on /v1/*, /metrics and /health, and a client that goes away mid-request: its
request is aborted and its KV freed (the running gauge drops back to 0 long before it could
finish)."""

from __future__ import annotations

import json
import socket
import time

import pytest
import requests
from serverkit import metric, scrape, wait_for


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": "test-key-0123456789"},
                                     {"Authorization": "Basic test-key-0123456789"},
                                     {"Authorization": "Bearer test-key-012345678"}])
def test_missing_or_wrong_key_is_401(server, headers):
    for method, route, body in [("GET", "/v1/models", None),
                                ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
                                ("POST", "/v1/chat/completions", {"messages": []})]:
        r = requests.request(method, server.base + route, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (route, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"


def test_right_key_is_200_and_openai_client_sends_it(server, client):
    r = requests.get(server.base + "/v1/models", headers=server.auth, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == server.model
    assert client.models.list().data[0].id == server.model
    import openai

    bad = openai.OpenAI(base_url=server.v1, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_health_needs_no_key_and_metrics_does(server):
    assert requests.get(server.base + "/health", timeout=30).status_code == 200
    assert requests.get(server.base + "/metrics", timeout=30).status_code == 401
    r = requests.get(server.base + "/metrics", headers=server.auth, timeout=30)
    assert r.status_code == 200 and "vllm:num_requests_running" in r.text


def _running(server) -> float:
    return metric(scrape(server), "vllm:num_requests_running")


def _open_stream(server, path: str, body: dict) -> socket.socket:
    """Send a request by hand and read until the first bytes of the answer."""
    host, port = server.base.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Authorization: Bearer {server.api_key}\r\nContent-Length: {len(payload)}\r\n"
              f"\r\n".encode() + payload)
    return s


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees(server, stream):
    """A request for 3000 tokens (tens of seconds on CPU), dropped after it started."""
    before = scrape(server)
    s = _open_stream(server, "/v1/completions", {
        "prompt": "A long story", "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
        "stream": stream})
    assert wait_for(lambda: _running(server) >= 1, timeout_s=30), "the request never started"
    if stream:
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    t_drop = time.monotonic()
    s.close()
    assert wait_for(lambda: _running(server) == 0, timeout_s=20), "still running after drop"
    freed_after = time.monotonic() - t_drop
    after = scrape(server)
    generated = (metric(after, "vllm:generation_tokens_total")
                 - metric(before, "vllm:generation_tokens_total"))
    assert generated < 3000, "the request ran to the end instead of being aborted"
    assert metric(after, "vllm:request_success_total", finished_reason="length") == \
        metric(before, "vllm:request_success_total", finished_reason="length")
    assert metric(after, "vllm:request_success_total", finished_reason="abort") == \
        metric(before, "vllm:request_success_total", finished_reason="abort") + 1
    assert freed_after < 20
    assert wait_for(lambda: metric(scrape(server), "vllm:kv_cache_usage_perc") == 0.0,
                    timeout_s=10), "KV blocks still held by the dropped request"
