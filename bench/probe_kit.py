"""Shared pieces of bench/hostile_probe.py: the server's address, per-family tallies and the
final table, and an HTTP/1.1 client on raw sockets whose every exchange ends by a deadline.

The client is raw on purpose: it sends exactly the bytes a probe builds (NUL in a header, a
padded key, a lying Content-Length), which ``requests`` would refuse or repair, and it tells a
hang (no complete answer by the deadline) from a reset or a refused connection.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    model: str            # the served model name
    key: str              # the API key
    header_s: float       # the proxy's header deadline
    body_s: float         # the ingress's body deadline
    vocab: int = 0        # the model's vocabulary size
    max_len: int = 0      # its max_model_len

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@dataclass
class Answer:
    """What one exchange got. ``kind``: http (a whole answer), hang (none complete by the
    deadline), conn (refused / reset / closed before a whole answer)."""

    kind: str
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    elapsed: float = 0.0
    closed: bool = False      # the server closed the connection
    error: str = ""

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def short(self, n: int = 160) -> str:
        if self.kind != "http":
            return f"{self.kind} after {self.elapsed:.1f}s {self.error} {self.body[:n]!r}"
        return f"{self.status} {self.body[:n]!r}"


def openai_error(body: bytes) -> dict | None:
    """The error object when ``body`` is exactly OpenAI's error shape, else None."""
    try:
        v = json.loads(body)
    except ValueError:
        return None
    err = v.get("error") if isinstance(v, dict) and set(v) == {"error"} else None
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return None
    if not (isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)):
        return None
    ok = all(err[k] is None or isinstance(err[k], str) for k in ("param", "code"))
    return err if ok else None


# --------------------------------------------------------------------------- raw HTTP


def request_bytes(method: str, path: str, body: bytes | None = None,
                  headers: Iterable[tuple[str, str]] | dict = (), close: bool = True) -> bytes:
    items = list(headers.items()) if isinstance(headers, dict) else list(headers)
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in items]
    if body is not None and not any(k.lower() in ("content-length", "transfer-encoding")
                                    for k, _ in items):
        lines.append(f"Content-Length: {len(body)}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + (body or b"")


def _parse_head(data: bytes) -> tuple[int, dict[str, str], bytes] | None:
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, rest


def dechunk(data: bytes) -> tuple[bytes, bool]:
    """(the body so far, whether the last chunk came) of a chunked body."""
    out, pos = bytearray(), 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            return bytes(out), False
        try:
            size = int(data[pos:end].split(b";")[0], 16)
        except ValueError:
            return bytes(out), True  # not chunked after all: take what came
        if size == 0:
            return bytes(out), True
        if len(data) < end + 2 + size + 2:
            out += data[end + 2:end + 2 + size]
            return bytes(out), False
        out += data[end + 2:end + 2 + size]
        pos = end + 2 + size + 2


def _complete(data: bytes) -> tuple[int, dict, bytes, bool] | None:
    parsed = _parse_head(data)
    while parsed is not None and 100 <= parsed[0] < 200:  # 100 Continue: the answer follows
        parsed = _parse_head(parsed[2])
    if parsed is None:
        return None
    status, headers, rest = parsed
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body, done = dechunk(rest)
        return status, headers, body, done
    if "content-length" in headers:
        n = int(headers["content-length"] or 0)
        return status, headers, rest[:n], len(rest) >= n
    return status, headers, rest, False  # until the server closes


def exchange(t: Target, raw: bytes | list[tuple[bytes, float]], deadline_s: float,
             linger_s: float = 0.0) -> Answer:
    """Send ``raw`` (or (bytes, pause-after) pieces) and read one answer by ``deadline_s``.
    ``linger_s``: after a whole answer, wait that long for the server to close."""
    t0 = time.monotonic()
    end = t0 + deadline_s
    pieces = [(raw, 0.0)] if isinstance(raw, bytes) else raw
    data, closed, err = b"", False, ""
    try:
        s = socket.create_connection((t.host, t.port), timeout=min(5.0, deadline_s))
    except OSError as exc:
        return Answer("conn", elapsed=time.monotonic() - t0, error=f"connect: {exc}")
    with s:
        try:
            for chunk, pause in pieces:
                s.sendall(chunk)
                if pause:
                    s.settimeout(pause)
                    try:
                        data += s.recv(65536)  # an early answer (408, 413) ends the sending
                        break
                    except TimeoutError:
                        pass
        except OSError as exc:  # closed while sending: the answer may still be there
            err = f"send: {type(exc).__name__}"
        done = _complete(data)
        while not (done and done[3]):
            left = end - time.monotonic()
            if left <= 0:
                return Answer("hang", *(done[:3] if done else (None, {}, data)),
                              elapsed=time.monotonic() - t0, error="deadline")
            s.settimeout(left)
            try:
                got = s.recv(65536)
            except TimeoutError:
                continue
            except OSError as exc:
                err, got = f"recv: {type(exc).__name__}", b""
            if not got:
                closed = True
                break
            data += got
            done = _complete(data)
        if done is None:
            return Answer("conn", body=data, elapsed=time.monotonic() - t0, closed=closed,
                          error=err or "closed without an answer")
        if not closed and linger_s:
            s.settimeout(linger_s)
            try:
                closed = s.recv(1) == b""
            except OSError:
                closed = True
    status, headers, body, _ = done
    return Answer("http", status, headers, body, time.monotonic() - t0, closed, err)


def post(t: Target, path: str, body: bytes | dict | list | None, deadline_s: float = 60.0,
         headers: dict | None = None, key: bool = True) -> Answer:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(t.auth if key else {}), **(headers or {})}
    return exchange(t, request_bytes("POST", path, data, h), deadline_s)


def get(t: Target, path: str, deadline_s: float = 30.0, key: bool = True) -> Answer:
    return exchange(t, request_bytes("GET", path, None, t.auth if key else {}), deadline_s)


def sse_events(body: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body: parsed JSON, "[DONE]", or the raw text."""
    out = []
    for line in body.decode("utf-8", "replace").split("\n"):
        if line.startswith("data: "):
            d = line[6:].strip()
            try:
                out.append(d if d == "[DONE]" else json.loads(d))
            except ValueError:
                out.append(d)
    return out


def stream_tokens(events: list[Any]) -> tuple[dict[int, list[int]], list[Any], bool]:
    """(token ids per choice index, error events, whether [DONE] came) of a stream whose
    request set ``return_token_ids``."""
    ids: dict[int, list[int]] = {}
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    for e in events:
        for c in (e.get("choices") or []) if isinstance(e, dict) else []:
            ids.setdefault(c["index"], []).extend(c.get("token_ids") or [])
    return ids, errors, "[DONE]" in events


# --------------------------------------------------------------------------- tallies


@dataclass
class Row:
    name: str
    tried: int = 0
    ok: int = 0
    oai4xx: int = 0
    bad4xx: int = 0
    s5xx: int = 0
    hangs: int = 0
    conn: int = 0
    mismatch: int = 0
    notes: list[str] = field(default_factory=list)
    http: bool = True     # False: not HTTP requests (the HTTP columns show "-")


class Tally:
    """Rows of the final table, and the findings (defects) with one example each."""

    def __init__(self, log: Any = None) -> None:
        self.rows: dict[str, Row] = {}
        self.findings: dict[tuple, list] = {}
        self.lock = threading.RLock()
        self.log = log  # a text file: one line per answer counted (--log)

    def row(self, name: str) -> Row:
        with self.lock:
            return self.rows.setdefault(name, Row(name))

    def note(self, name: str, text: str) -> None:
        self.row(name).notes.append(text)

    def finding(self, name: str, what: str, repro: str, got: str) -> None:
        """A defect: counted per (row, what), the first three examples kept."""
        with self.lock:
            f = self.findings.setdefault((name, what), [0, []])
            f[0] += 1
            if len(f[1]) < 3:
                f[1].append((repro, got))

    def record(self, name: str, ans: Answer, expect: str, repro: str) -> Answer:
        """Count ``ans`` in row ``name``. ``expect``: "4xx" (an OpenAI-shaped 4xx), "2xx",
        "ok" (either), "any" (no expectation but no 5xx), or an exact status ("408")."""
        r = self.row(name)
        with self.lock:
            r.tried += 1
            if self.log is not None:
                print(f"{name}\t{expect}\t{ans.kind}\t{ans.status}\t{ans.elapsed:.2f}\t"
                      f"{repro[:300]!r}", file=self.log, flush=True)
        if ans.kind != "http":
            with self.lock:
                if ans.kind == "hang":
                    r.hangs += 1
                else:
                    r.conn += 1
            self.finding(name, ans.kind, repro, ans.short())
            return ans
        st = ans.status or 0
        shaped = openai_error(ans.body) is not None
        with self.lock:
            if 200 <= st < 300:
                r.ok += 1
            elif 400 <= st < 500:
                r.oai4xx += shaped
                r.bad4xx += not shaped
            elif st >= 500:
                r.s5xx += 1
        if st >= 500:
            self.finding(name, f"{st}", repro, ans.short())
        elif 400 <= st < 500 and not shaped:
            self.finding(name, f"{st} not in OpenAI shape", repro, ans.short())
        elif not _as_expected(st, expect):
            with self.lock:
                r.mismatch += 1
            self.finding(name, f"expected {expect}, got {st}", repro, ans.short())
        return ans

    def mismatch(self, name: str, what: str, repro: str, got: str, n: int = 1) -> None:
        with self.lock:
            self.row(name).mismatch += n
        self.finding(name, what, repro, got)


def _as_expected(status: int, expect: str) -> bool:
    if expect == "any":
        return True
    if expect == "ok":
        return 200 <= status < 300 or 400 <= status < 500
    if expect == "2xx":
        return 200 <= status < 300
    if expect == "4xx":
        return 400 <= status < 500
    return str(status) == expect


def render(tally: Tally) -> str:
    cols = ["family", "tried", "2xx", "4xx-oai", "4xx-other", "5xx", "hangs", "conn-err",
            "mismatch", "notes"]
    lines = [[r.name, r.tried, *([r.ok, r.oai4xx, r.bad4xx, r.s5xx, r.hangs, r.conn] if r.http
                                 else ["-"] * 6), r.mismatch, "; ".join(r.notes)]
             for r in tally.rows.values()]
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *lines)]
    widths[-1] = len(cols[-1])
    fmt = "  ".join(f"{{:<{w}}}" if i in (0, 9) else f"{{:>{w}}}" for i, w in enumerate(widths))
    out = [fmt.format(*cols), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*line) for line in lines]
    return "\n".join(out)


def render_findings(tally: Tally) -> str:
    if not tally.findings:
        return "findings: none"
    out = [f"findings ({len(tally.findings)} kinds):"]
    for (name, what), (n, examples) in tally.findings.items():
        out.append(f"- [{name}] {what} x{n}")
        for repro, got in examples:
            out.append(f"    request: {repro[:400]}\n      got: {got[:400]}")
    return "\n".join(out)


class MemWatch(threading.Thread):
    """Samples every 0.5 s the resident memory of this process's descendants (the local Ray
    cluster it started) whose command line holds one of ``markers`` (the ingress replica, the
    head, the EP ranks): the peak per marker since the last ``take``."""

    def __init__(self, markers: dict[str, str]):
        super().__init__(daemon=True)
        self.markers, self.peaks, self.stop = markers, {}, threading.Event()

    def run(self) -> None:
        import ray  # noqa: F401  (puts Ray's vendored psutil on the path)
        import psutil

        me = psutil.Process()
        while not self.stop.wait(0.5):
            seen: dict[str, int] = {}
            for p in me.children(recursive=True):
                try:
                    line = " ".join(p.cmdline())
                    for name, marker in self.markers.items():
                        if marker in line:
                            seen[name] = max(seen.get(name, 0), p.memory_info().rss)
                except (psutil.Error, OSError):
                    continue
            peaks = self.peaks  # take() swaps the dict: update the one read now
            for name, rss in seen.items():
                peaks[name] = max(peaks.get(name, 0), rss)

    def take(self) -> str:
        peaks, self.peaks = self.peaks, {}
        return ", ".join(f"{k} {v / 2**20:.0f}MB" for k, v in sorted(peaks.items()))
