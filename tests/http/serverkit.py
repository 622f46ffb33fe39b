"""Helpers of the HTTP tests: the server's address and key, free ports, /metrics scraping,
polling."""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass

API_KEY = "test-key-0123456789"
HEAD_NAME = "epserve-head-http-tests"
APP_NAME = "epserve-http-tests"
# short deadlines, so the tests of a stalled head or body wait seconds, not the defaults' 30
HEADER_READ_TIMEOUT_S = 4.0
BODY_READ_TIMEOUT_S = 4.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Server:
    base: str          # http://127.0.0.1:PORT
    model: str         # the served model name
    api_key: str

    @property
    def v1(self) -> str:
        return f"{self.base}/v1"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$')


def scrape(server: Server) -> dict[str, float]:
    """GET /metrics as {'name{labels}': value} (labels as written)."""
    import requests

    r = requests.get(f"{server.base}/metrics", headers=server.auth, timeout=30)
    assert r.status_code == 200, r.text
    out = {}
    for line in r.text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The value of ``name`` whose labels include ``labels`` (0.0 when absent)."""
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            return value
    return 0.0


def delete_app(name: str) -> None:
    """``serve.delete(name)`` without waiting for it: the blocking call polls (every 1 s) until
    the app's replica has sat out Serve's graceful-shutdown loop, ~3 s, though nothing is in
    flight at a fixture's teardown. Serve's controller still deletes it; calls from here reach
    the controller in order, so the last test's ``serve.shutdown`` waits for it."""
    from ray import serve

    serve.delete(name, _blocking=False)


def wait_for(pred, timeout_s: float = 20.0, every_s: float = 0.1):
    """Poll ``pred`` until it returns a truthy value (returned) or time runs out (None)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(every_s)
    return None
