"""Helpers of the HTTP tests: the server's address and key, free ports, /metrics scraping,
polling."""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass
from typing import Callable

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


# ------------------------------------------------ apps beside the session's server
# A module's own app (another engine, config or model) is registered when the module is
# imported (collection), under the fixture that serves it. Each is deployed one ahead: the
# first one the selected tests use as the session's server comes up, each next one as soon as
# the one before is healthy, so it starts while the tests in between run (in their modules'
# set-ups, one by one, each had taken 4-7 s). Its fixture waits for its health, and removes
# app and head after its tests.


@dataclass
class SideApp:
    name: str                # the Serve app
    prefix: str              # its route prefix on the session's proxy
    config: Callable         # getfixturevalue -> build_app's config (dict or AppConfig)
    head: str | None = None  # its engine's head_name, once deployed


SIDE_APPS: dict[str, SideApp] = {}  # by the name of the fixture that serves it
_ORDER: list[str] = []  # the registered fixtures in the order the selected tests first use them


def side_app(fixture: str, name: str, prefix: str, config: Callable) -> None:
    """Register the app that ``fixture`` serves (at module import)."""
    SIDE_APPS[fixture] = SideApp(name, prefix, config)


def plan_side_apps(items, getfixture) -> None:
    """The order the selected ``items`` first use the registered apps in; the first deployed."""
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            if fixture in SIDE_APPS and fixture not in _ORDER:
                _ORDER.append(fixture)
    if _ORDER:
        _deploy(_ORDER[0], getfixture)


def _deploy(fixture: str, getfixture) -> None:
    """Deploy ``fixture``'s app (once), without waiting for it to start."""
    from ray import serve

    from epserve.deploy.app import build_app
    from epserve.deploy.config import AppConfig

    app = SIDE_APPS[fixture]
    if app.head is not None:
        return
    cfg = app.config(getfixture)
    cfg = cfg if isinstance(cfg, AppConfig) else AppConfig.from_dict(cfg)
    app.head = cfg.head_name
    serve.run_many([serve.RunTarget(build_app(cfg), name=app.name, route_prefix=app.prefix)],
                   wait_for_ingress_deployment_creation=False,
                   wait_for_applications_running=False)


def side_app_base(fixture: str, server: Server, getfixture, what: str) -> str:
    """The URL of ``fixture``'s app once it is healthy (deployed now if it was not yet); the
    next app in the plan is deployed then."""
    import requests

    _deploy(fixture, getfixture)
    base = server.base + SIDE_APPS[fixture].prefix

    def healthy() -> bool:
        try:
            return requests.get(f"{base}/health", timeout=10).status_code == 200
        except requests.RequestException:  # queued by the proxy while the app deploys
            return False

    assert wait_for(healthy, timeout_s=240), f"{what} never became healthy"
    later = _ORDER[_ORDER.index(fixture) + 1:] if fixture in _ORDER else []
    if later:
        _deploy(later[0], getfixture)
    return base


def remove_side_app(fixture: str) -> None:
    """The app (unless Serve already went, after the last HTTP test), then its head."""
    from ray.serve.exceptions import RayServeException

    from epserve.cluster.bringup import stop_head

    app = SIDE_APPS[fixture]
    try:
        delete_app(app.name)
    except RayServeException:  # the session's cleanup shut Serve, and every app, down first
        pass
    if app.head is not None:
        stop_head(app.head)


def stop_side_heads() -> None:
    """The heads of every side app deployed (after Serve's shutdown, at the session's end)."""
    from epserve.cluster.bringup import stop_head

    for app in SIDE_APPS.values():
        if app.head is not None:
            stop_head(app.head)
