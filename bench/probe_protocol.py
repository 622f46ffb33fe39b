"""Family 2 of bench/hostile_probe.py: abuse below the JSON, on raw sockets.

Rows: ``protocol`` (request lines and headers the parser must refuse with an OpenAI-shaped
400/431, lying lengths, bad chunking, paths that try to get round the key, pipelining),
``auth`` (every key variant on every route: /health open, everything else 401 without the
exact key), ``slow`` (idle, stalled and dribbled heads and bodies: a 408 within the deadline
and the connection closed; 150 held connections while /health must stay fast; a client that
drops its stream must not leave the request running).
"""

from __future__ import annotations

import base64
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from probe_kit import Tally, Target, exchange, get, post, request_bytes

JSON = {"Content-Type": "application/json"}


def _parse_errors() -> list[tuple[str, bytes, str]]:
    rnd = bytes(random.Random(2).randrange(256) for _ in range(48))
    h = b"Host: x\r\n"
    return [
        ("garbage request line", b"GARBAGE\x01 / HTTP/1.1\r\n\r\n", "400"),
        ("method only", b"GET\r\n\r\n", "400"),
        ("HTTP/9.9", b"GET /health HTTP/9.9\r\n" + h + b"\r\n", "4xx"),
        ("TLS ClientHello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + rnd, "400"),
        ("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "4xx"),
        ("NUL in a header value", b"GET /health HTTP/1.1\r\n" + h + b"X: a\x00b\r\n\r\n", "400"),
        ("space in a header name", b"GET /health HTTP/1.1\r\n" + h + b"Bad H: y\r\n\r\n", "400"),
        ("header without colon", b"GET /health HTTP/1.1\r\n" + h + b"NoColon\r\n\r\n", "400"),
        ("obs-fold header", b"GET /health HTTP/1.1\r\n" + h + b"X: a\r\n b\r\n\r\n", "400"),
        ("bare LF line ends", b"GET /health HTTP/1.1\n" + b"Host: x\n\n", "any"),
        ("duplicate Content-Length 3/4", b"POST /tokenize HTTP/1.1\r\n" + h +
         b"Content-Length: 3\r\nContent-Length: 4\r\n\r\n{}x", "400"),
        ("Content-Length -1", b"POST /tokenize HTTP/1.1\r\n" + h + b"Content-Length: -1\r\n\r\n",
         "400"),
        ("Content-Length abc", b"POST /tokenize HTTP/1.1\r\n" + h +
         b"Content-Length: abc\r\n\r\n", "400"),
        ("Content-Length and chunked", b"POST /tokenize HTTP/1.1\r\n" + h +
         b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "4xx"),
        ("chunk size zz", b"POST /tokenize HTTP/1.1\r\n" + h +
         b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", "400"),
        ("chunk size 2**72", b"POST /tokenize HTTP/1.1\r\n" + h +
         b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\nab\r\n", "400"),
        ("chunk longer than its size", b"POST /tokenize HTTP/1.1\r\n" + h +
         b"Transfer-Encoding: chunked\r\n\r\n2\r\nabcdef\r\n0\r\n\r\n", "400"),
        ("Transfer-Encoding gzip, chunked", b"POST /tokenize HTTP/1.1\r\n" + h +
         b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", "4xx"),
        ("header of 70 KiB in one write", b"GET /health HTTP/1.1\r\n" + h + b"X-Big: " +
         b"a" * (70 << 10) + b"\r\n\r\n", "431"),
        ("header of 200 KiB in one write", b"GET /health HTTP/1.1\r\n" + h + b"X-Big: " +
         b"a" * (200 << 10) + b"\r\n\r\n", "431"),
        ("header of 1 MiB in one write", b"GET /health HTTP/1.1\r\n" + h + b"X-Big: " +
         b"a" * (1 << 20) + b"\r\n\r\n", "431"),
        ("2000 headers (80 KiB)", b"GET /health HTTP/1.1\r\n" + h +
         b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 30) for i in range(2000)) + b"\r\n", "431"),
        ("request line of 70 KiB", b"GET /" + b"a" * 71680 + b" HTTP/1.1\r\n" + h + b"\r\n",
         "4xx"),
    ]


def _dribbled_head(t: Target) -> tuple[str, list, str]:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "
    return ("header of 70 KiB in 10 KiB pieces",
            [(head, 0.0)] + [(b"a" * 10240, 0.05)] * 7 + [(b"\r\n\r\n", 0.0)], "431")


def parse_errors(tally: Tally, t: Target) -> None:
    def one(case):
        label, raw, expect = case
        ans = exchange(t, raw, 20.0, linger_s=2.0)
        shown = raw[:120] if isinstance(raw, bytes) else raw[0][0][:120]
        tally.record("protocol", ans, expect, f"raw {label}: {shown!r}")
        if ans.kind == "http" and (ans.status or 0) >= 400 and not ans.closed:
            tally.mismatch("protocol", "error answer left the connection open",
                           f"raw {label}", ans.short())

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, _parse_errors() + [_dribbled_head(t)]))


BYPASS = ["/metrics", "//metrics", "/metrics/", "/METRICS", "/health/../metrics",
          "/v1/../metrics", "/metrics%00", "/%6detrics", "/metrics?x=/health", "/health/",
          "/./metrics", "/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect",
          "/v1/models", "/no-such-route", "http://127.0.0.1/metrics"]


def path_bypass(tally: Tally, t: Target) -> None:
    """No key: every path but /health itself is a 401 (or a 4xx the parser gives), and never
    the metrics text or the API schema."""
    for path in BYPASS:
        ans = exchange(t, request_bytes("GET", path), 20.0)
        tally.record("auth", ans, "401" if path != "http://127.0.0.1/metrics" else "4xx",
                     f"GET {path} without a key")
        if ans.kind == "http" and (b"vllm:" in ans.body or b'"paths"' in ans.body):
            tally.mismatch("auth", "served without the key", f"GET {path}", ans.short())
    ans = exchange(t, request_bytes("GET", "/health?x=1"), 20.0)
    tally.record("auth", ans, "200", "GET /health?x=1 without a key")


def _key_variants(key: str) -> list[tuple[str, str | None, str]]:
    """(label, Authorization header or None, expectation): accept / refuse / either."""
    b64 = base64.b64encode(f"user:{key}".encode()).decode()
    return [("no header", None, "refuse"), ("wrong key", "Bearer nope", "refuse"),
            ("empty bearer", "Bearer ", "refuse"), ("scheme only", "Bearer", "refuse"),
            ("key prefix", f"Bearer {key[:-1]}", "refuse"), ("key + x", f"Bearer {key}x",
                                                               "refuse"),
            ("bare key", key, "refuse"), ("Basic", f"Basic {b64}", "refuse"),
            ("Token scheme", f"Token {key}", "refuse"), ("upper key", f"Bearer {key.upper()}",
                                                          "refuse"),
            ("key with NUL", f"Bearer {key}\x00", "either"),
            ("padded key", f"Bearer  {key}  ", "either"), ("tab-padded key", f"Bearer\t{key}",
                                                           "either"),
            ("lowercase scheme", f"bearer {key}", "either"), ("right key", f"Bearer {key}",
                                                              "accept")]


ROUTES = [("POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 1}'),
          ("POST", "/v1/chat/completions",
           b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}'),
          ("POST", "/tokenize", b'{"prompt": "Hi"}'), ("POST", "/detokenize", b'{"tokens": [1]}'),
          ("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/docs", None),
          ("GET", "/openapi.json", None), ("GET", "/redoc", None), ("GET", "/health", None),
          ("GET", "/no-such-route", None)]


def auth_matrix(tally: Tally, t: Target) -> None:
    def one(args) -> None:
        (method, path, body), (label, header, want) = args
        h = {**JSON} if body is not None else {}
        if header is not None:
            h["Authorization"] = header
        ans = exchange(t, request_bytes(method, path, body, h), 60.0)
        repro = f"{method} {path} Authorization: {header!r} ({label})"
        expect = "any" if path == "/health" or want == "either" else \
            "401" if want == "refuse" else "any"
        tally.record("auth", ans, expect, repro)
        if ans.kind != "http":
            return
        if path == "/health" and ans.status != 200 and want != "either":
            tally.mismatch("auth", "/health refused", repro, ans.short())
        elif path != "/health" and want == "accept" and ans.status == 401:
            tally.mismatch("auth", "the right key refused", repro, ans.short())

    cases = [(r, k) for r in ROUTES for k in _key_variants(t.key)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, cases))
    for key in (True, False):
        ans = post(t, "/v1/completions", b'{"prompt": "x"}', 20.0,
                   headers={"Content-Type": "text/plain"}, key=key)
        tally.record("auth", ans, "415" if key else "401",
                     f"POST /v1/completions text/plain {'with' if key else 'without'} the key")


# --------------------------------------------------------------------------- slow clients


def _slow_cases(t: Target) -> list[tuple[str, list, float]]:
    """(label, pieces, the deadline that must cut it)."""
    body = b'{"prompt": "Hi", "max_tokens": 1}'
    head = request_bytes("POST", "/v1/completions", None,
                         {**t.auth, **JSON, "Content-Length": str(len(body) + 50)})
    get_head = request_bytes("GET", "/v1/models", None, t.auth)
    stall = t.body_s + 12
    drib = [(bytes([b]), 0.5) for b in get_head[:int(2.5 * t.header_s)]]
    return [
        ("idle connection", [(b"", stall)], t.header_s),
        ("half a head, then nothing", [(get_head[:20], stall)], t.header_s),
        ("head dribbled 1 byte / 0.5 s", drib + [(b"", stall)], t.header_s),
        ("body stalled after 10 bytes", [(head + body[:10], stall)], t.body_s),
        ("body dribbled 1 byte / 0.5 s", [(head, 0.0)] + [(body[i:i + 1], 0.5) for i in
                                                         range(len(body))] + [(b"", stall)],
         t.body_s),
        ("body short of its Content-Length", [(head + body, stall)], t.body_s),
    ]


def slow_clients(tally: Tally, t: Target) -> None:
    def one(case) -> None:
        label, pieces, limit = case
        ans = exchange(t, pieces, limit + 20.0, linger_s=3.0)
        repro = f"{label} (deadline {limit:g} s)"
        tally.record("slow", ans, "408", repro)
        if ans.kind == "http" and ans.status == 408:
            if ans.elapsed > limit + 5.0:
                tally.mismatch("slow", f"cut after {ans.elapsed:.1f} s", repro, ans.short())
            if not ans.closed:
                tally.mismatch("slow", "408 but the connection stayed open", repro, ans.short())
        took.append(ans.elapsed)

    took: list[float] = []
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(one, _slow_cases(t)))
    tally.note("slow", f"stalled cut in {min(took):.1f}-{max(took):.1f}s")


def held_connections(tally: Tally, t: Target, n_idle: int = 100, n_body: int = 50) -> None:
    """Many idle connections and many stalled bodies at once: /health must stay fast, a
    request must still be served, and the server must close every one of them."""
    socks, t0 = [], time.monotonic()
    body_head = request_bytes("POST", "/tokenize", None, {**t.auth, **JSON,
                                                          "Content-Length": "100"})
    for i in range(n_idle + n_body):
        try:
            s = socket.create_connection((t.host, t.port), timeout=5)
            if i >= n_idle:
                s.sendall(body_head + b'{"prompt"')
            socks.append(s)
        except OSError as exc:
            tally.finding("slow", "could not open a connection", f"connection {i}", str(exc))
    lat = []
    for _ in range(5):
        ans = get(t, "/health", 10.0, key=False)
        tally.record("slow", ans, "200", f"GET /health beside {len(socks)} held connections")
        lat.append(ans.elapsed)
    ans = post(t, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, 60.0)
    tally.record("slow", ans, "2xx", f"a completion beside {len(socks)} held connections")
    closed = _count_closed(socks, t0 + max(t.header_s, t.body_s) + 10.0)
    if closed < len(socks):
        tally.mismatch("slow", f"{len(socks) - closed} held connections still open",
                       f"{n_idle} idle + {n_body} stalled-body connections",
                       f"closed {closed}/{len(socks)}")
    tally.note("slow", f"{len(socks)} held: /health max {max(lat) * 1000:.0f}ms, "
                       f"{closed} closed by the server")


def _count_closed(socks: list[socket.socket], until: float) -> int:
    closed = 0
    for s in socks:
        try:
            s.settimeout(max(0.05, until - time.monotonic()))
            while s.recv(65536):
                pass
            closed += 1
        except OSError:
            pass
        finally:
            s.close()
    return closed


def dropped_stream(tally: Tally, t: Target) -> None:
    """A client asks for 3000 tokens and goes away: the request must stop running."""
    from probe_kit import get as _get

    for stream in (True, False):
        body = (b'{"prompt": "A long story", "max_tokens": 3000, "temperature": 0, '
                b'"ignore_eos": true, "stream": %s}' % (b"true" if stream else b"false"))
        s = socket.create_connection((t.host, t.port), timeout=10)
        s.sendall(request_bytes("POST", "/v1/completions", body, {**t.auth, **JSON}))
        time.sleep(1.5)
        s.close()
        t_drop = time.monotonic()
        running = None
        while time.monotonic() - t_drop < 20:
            m = _get(t, "/metrics", 10.0)
            running = _metric(m.body, "vllm:num_requests_running")
            if running == 0:
                break
            time.sleep(0.3)
        repro = f"POST /v1/completions max_tokens 3000 stream={stream}, socket closed at 1.5 s"
        tally.row("slow").tried += 1
        if running != 0:
            tally.mismatch("slow", "a dropped request kept running", repro, f"running={running}")
        else:
            tally.note("slow", f"dropped {'stream' if stream else 'request'} freed in "
                               f"{time.monotonic() - t_drop:.1f}s")


def _metric(text: bytes, name: str) -> float | None:
    for line in text.decode("utf-8", "replace").splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def methods(tally: Tally, t: Target) -> None:
    """Other methods on the routes: 401 without the key, an OpenAI-shaped 4xx with it."""
    for method in ("PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "FOO"):
        for path in ("/v1/completions", "/v1/models", "/metrics"):
            for key in (False, True):
                raw = request_bytes(method, path, b"{}", {**JSON, **(t.auth if key else {})})
                ans = exchange(t, raw, 20.0)
                # an unknown method may be refused by the parser first (400)
                tally.record("protocol", ans, "4xx" if key or method == "FOO" else "401",
                             f"{method} {path} {'with' if key else 'without'} the key")
    ans = exchange(t, request_bytes("POST", "/v1/completions", None, {
        **t.auth, **JSON, "Content-Length": str(2 << 20), "Expect": "100-continue"}), 20.0)
    tally.record("protocol", ans, "413", "POST /v1/completions Expect: 100-continue, "
                                         "Content-Length 2 MiB, no body sent")


def pipelined(tally: Tally, t: Target) -> None:
    one = request_bytes("GET", "/v1/models", None, t.auth, close=False)
    ans = exchange(t, one + one + request_bytes("GET", "/health"), 20.0, linger_s=2.0)
    tally.record("protocol", ans, "200", "three pipelined GETs on one connection")


def run(tally: Tally, t: Target, quick: bool) -> None:
    slow = threading.Thread(target=slow_clients, args=(tally, t), daemon=True)
    slow.start()  # mostly waiting: beside the rest
    parse_errors(tally, t)
    path_bypass(tally, t)
    auth_matrix(tally, t)
    methods(tally, t)
    pipelined(tally, t)
    slow.join(120)
    if slow.is_alive():
        tally.finding("slow", "the slow-client probes did not end", "slow_clients", "")
    if not quick:
        held_connections(tally, t)
    dropped_stream(tally, t)
