"""The HTTP edge against what a careless or hostile client sends: the key on every path but
/health (docs and /metrics included), a stalled head or body answered 408 and the connection
closed, an endless head 431, a configured key's whitespace ignored, JSON routes refusing other
media types, and the proxy's own errors (a request uvicorn cannot parse) in OpenAI's shape."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from serverkit import BODY_READ_TIMEOUT_S, HEADER_READ_TIMEOUT_S, free_port, wait_for

JSON_ROUTES = {"/v1/completions": {"prompt": "Hi", "max_tokens": 1},
               "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}],
                                        "max_tokens": 1},
               "/tokenize": {"prompt": "Hello"}, "/detokenize": {"tokens": [1, 2, 3]}}
KEYED_PATHS = ["/metrics", "/docs", "/openapi.json", "/redoc", "/docs/oauth2-redirect",
               "/v1/models", "/no-such-route"]


def _openai_error(status: int, body: bytes | str) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("service_unavailable" if status == 503 else "server_error"
                           if status >= 500 else "invalid_request_error")
    return err


def _raw(server, data: bytes, *, wait_s: float = 30.0) -> tuple[bytes, float, bool]:
    """Send ``data`` on a fresh connection and read until the server closes it: (what came
    back, seconds it took, whether the server closed the connection)."""
    host, port = server.base.removeprefix("http://").split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            return out, time.monotonic() - t0, False
    return out, time.monotonic() - t0, True


def _split(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


# ---------------------------------------------------------------- 1. the key everywhere


@pytest.mark.parametrize("path", KEYED_PATHS)
def test_every_path_but_health_needs_the_key(server, path):
    r = requests.get(server.base + path, timeout=30)
    assert r.status_code == 401, (path, r.text[:200])
    assert _openai_error(401, r.content)["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    wrong = requests.get(server.base + path, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401
    r = requests.get(server.base + path, headers=server.auth, timeout=30)
    if path == "/no-such-route":  # with the key, unknown routes are still OpenAI's 404
        assert r.status_code == 404 and _openai_error(404, r.content)
    else:
        assert r.status_code == 200, (path, r.text[:200])
    assert requests.get(server.base + "/health", timeout=30).status_code == 200


def test_openapi_with_the_key_lists_the_routes(server):
    r = requests.get(server.base + "/openapi.json", headers=server.auth, timeout=30)
    assert "/v1/chat/completions" in r.json()["paths"]


class _Uvicorn:
    """``make_fastapi_app`` under plain uvicorn on a free port (no engine: the docs routes
    and the gate need none)."""

    def __init__(self, api_key: str | None):
        import uvicorn

        from epserve.deploy.app import make_fastapi_app
        from epserve.deploy.config import AppConfig
        from epserve.deploy.gate import Gate

        key = AppConfig(api_key=api_key).resolved_api_key()
        app = make_fastapi_app(None, Gate(key, 1 << 20, 5.0))
        self.base = f"http://127.0.0.1:{free_port()}"
        port = int(self.base.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    lifespan="off", log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        assert wait_for(lambda: self.server.started, timeout_s=20), "uvicorn did not start"
        return self.base

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_without_a_key_everything_stays_open(monkeypatch):
    monkeypatch.delenv("EPSERVE_API_KEY", raising=False)
    with _Uvicorn(None) as base:
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert requests.get(base + path, timeout=30).status_code == 200, path
        r = requests.get(base + "/no-such-route", timeout=30)
        assert r.status_code == 404 and _openai_error(404, r.content)


# ---------------------------------------------------------------- 3. the key's whitespace


@pytest.mark.parametrize("configured", [" k-123\n", "k-123\r\n", "\tk-123 "])
def test_a_configured_key_with_whitespace_matches_the_key(monkeypatch, configured):
    monkeypatch.delenv("EPSERVE_API_KEY", raising=False)
    with _Uvicorn(configured) as base:
        ok = requests.get(base + "/openapi.json", headers={"Authorization": "Bearer k-123"},
                          timeout=30)
        assert ok.status_code == 200
        assert requests.get(base + "/openapi.json", timeout=30).status_code == 401


def test_the_key_from_the_environment_is_stripped(monkeypatch):
    from epserve.deploy.config import AppConfig

    monkeypatch.setenv("EPSERVE_API_KEY", "k-123\n")  # as `EPSERVE_API_KEY=$(cat keyfile)`
    assert AppConfig().resolved_api_key() == "k-123"


@pytest.mark.parametrize("blank", ["", " ", "\n", " \t\r\n"])
def test_a_blank_key_is_refused_at_start(monkeypatch, blank):
    from epserve.deploy.config import AppConfig

    with pytest.raises(ValueError, match="api_key is empty or only whitespace"):
        AppConfig.from_dict({"api_key": blank})
    monkeypatch.setenv("EPSERVE_API_KEY", blank)  # set but blank: not silently "no auth"
    with pytest.raises(ValueError, match="EPSERVE_API_KEY is empty or only whitespace"):
        AppConfig().resolved_api_key()


# ---------------------------------------------------------------- 4. Content-Type


@pytest.mark.parametrize("route", sorted(JSON_ROUTES))
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x",
                                          "application/jsonx", None])
def test_json_routes_refuse_other_media_types(server, route, content_type):
    headers = {**server.auth, "Content-Type": content_type}  # None: requests sends none
    r = requests.post(server.base + route, data=json.dumps(JSON_ROUTES[route]),
                      headers=headers, timeout=60)
    assert r.status_code == 415, (route, content_type, r.text[:200])
    err = _openai_error(415, r.content)
    assert err["code"] == "unsupported_media_type"
    assert (content_type or "no Content-Type") in err["message"]


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON",
                                          "application/json; charset=utf-8",
                                          "APPLICATION/JSON ;charset=UTF-8"])
def test_json_with_parameters_and_any_case_is_accepted(server, content_type):
    r = requests.post(server.base + "/tokenize", data=json.dumps({"prompt": "Hello"}),
                      headers={**server.auth, "Content-Type": content_type}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_browser_simple_request_without_the_key_is_refused(server):
    """A text/plain POST needs no CORS preflight; with a key it is a 401 before anything."""
    r = requests.post(server.base + "/v1/completions", data='{"prompt": "x"}',
                      headers={"Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 401


def test_the_openai_client_sends_json(client):
    assert client.completions.create(model="demo", prompt="Hi", max_tokens=1).choices


# ---------------------------------------------------------------- 2. stalled heads and bodies


def test_stalled_heads_and_bodies_are_408_and_the_connection_closed(server):
    """Each on a connection of its own, all at once (the deadlines are waited out once, not
    once per case): nothing sent, a request line cut short, a head without its blank line
    (the head deadline), and a body short of its Content-Length (the body deadline)."""
    body = json.dumps(JSON_ROUTES["/v1/completions"]).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {server.api_key}\r\nContent-Length: {len(body) + 50}\r\n"
            f"\r\n").encode()
    stalled = {"nothing": (b"", HEADER_READ_TIMEOUT_S),
               "a head without its end": (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n",
                                          HEADER_READ_TIMEOUT_S),
               "half a request line": (b"POST /v1/compl", HEADER_READ_TIMEOUT_S),
               "a short body": (head + body, BODY_READ_TIMEOUT_S)}
    with ThreadPoolExecutor(len(stalled)) as pool:
        futures = {what: pool.submit(_raw, server, sent, wait_s=deadline + 20)
                   for what, (sent, deadline) in stalled.items()}
    for what, (_, deadline) in stalled.items():
        answer, took, closed = futures[what].result()
        assert closed, (what, answer)
        status, headers, payload = _split(answer)
        assert status == 408 and headers["connection"] == "close", (what, answer)
        assert _openai_error(408, payload)["code"] == "request_timeout"
        assert deadline - 0.5 <= took < deadline + 15, (what, took)


def test_an_endless_head_is_431_and_the_connection_closed(server):
    """uvicorn's httptools parser buffers a head of any size; the proxy caps it at 64 KiB."""
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        for _ in range(7):  # 70 KiB in pieces the proxy reads as they come (no reset)
            s.sendall(b"a" * 10240)
            time.sleep(0.05)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    status, headers, payload = _split(answer)
    assert status == 431 and headers["connection"] == "close"
    assert _openai_error(431, payload)["code"] == "request_too_large"


@pytest.mark.parametrize("head", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (70 << 10) + b"\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\n"
    + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 30) for i in range(2000)) + b"\r\n",
    b"GET /health?" + b"q" * (70 << 10) + b" HTTP/1.1\r\nHost: x\r\n\r\n",
], ids=["one-big-header", "2000-headers", "long-url"])
def test_a_whole_oversized_head_in_one_write_is_431(server, head):
    """The cap holds when the whole head arrives at once (parsed in one read) too."""
    answer, _, closed = _raw(server, head)
    status, headers, payload = _split(answer)
    assert closed and status == 431 and headers["connection"] == "close", answer[:200]
    assert _openai_error(431, payload)["code"] == "request_too_large"


def test_a_large_head_under_the_cap_is_served(server):
    answer, _, _ = _raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                        b"X-Big: " + b"a" * (60 << 10) + b"\r\n\r\n")
    assert _split(answer)[0] == 200, answer[:200]


def _exchange(sock: socket.socket, request: bytes) -> int:
    """One request on an open keep-alive connection; the answer's status (body read)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or b"<closed>"
        assert not data.endswith(b"<closed>"), data
    status, headers, body = _split(data)
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return status


def test_an_idle_keep_alive_connection_outlives_the_head_deadline(server):
    """The head deadline runs from a request's first byte, not across an idle keep-alive."""
    host, port = server.base.removeprefix("http://").split(":")
    request = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " \
              f"{server.api_key}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        assert _exchange(s, request) == 200
        time.sleep(HEADER_READ_TIMEOUT_S + 1)
        assert _exchange(s, request) == 200  # the same connection, still open


# ---------------------------------------------------------------- 5. the proxy's own answers


@pytest.mark.parametrize("sent", [
    b"GARBAGE\x01 / HTTP/1.1\r\n\r\n",                                   # request line
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",         # header name
    b"GET /health HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n",             # header value
    b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
    b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
])
def test_a_request_uvicorn_cannot_parse_is_an_openai_400(server, sent):
    answer, _, closed = _raw(server, sent)
    status, headers, payload = _split(answer)
    assert status == 400 and headers["content-type"] == "application/json", answer
    assert _openai_error(400, payload)["code"] == "invalid_http_request"
    assert closed
    assert requests.get(server.base + "/health", timeout=30).status_code == 200


def test_the_proxys_own_text_errors_become_openai_errors():
    """What Serve's proxy writes itself (a 503 while no replica is ready, a 404 outside every
    route prefix) goes through ``ProxyErrorsAsJson`` as OpenAI's error JSON; a JSON error or
    a success passes through byte for byte."""
    import asyncio

    from ray.serve._private.http_util import convert_object_to_asgi_messages

    from epserve.deploy.proxy_edge import ProxyErrorsAsJson

    def run(obj, status):
        async def app(scope, receive, send):
            for message in convert_object_to_asgi_messages(obj, status_code=status):
                await send(message)
        sent: list[dict] = []

        async def send(message):
            sent.append(message)
        asyncio.run(ProxyErrorsAsJson(app)({"type": "http"}, None, send))
        return sent[0]["status"], dict(sent[0]["headers"]), b"".join(
            m.get("body", b"") for m in sent[1:])

    status, headers, body = run("Service unavailable: no replica is ready.", 503)
    assert status == 503 and headers[b"content-type"] == b"application/json"
    assert _openai_error(503, body)["message"] == "Service unavailable: no replica is ready."
    assert int(headers[b"content-length"]) == len(body)
    status, _, body = run("Path '/x' not found.", 404)
    assert status == 404 and _openai_error(404, body)["message"] == "Path '/x' not found."
    for obj, status in [({"error": {"message": "m"}}, 400), ("fine", 200)]:
        expected = convert_object_to_asgi_messages(obj, status_code=status)[1]["body"]
        assert run(obj, status)[2] == expected
