"""The HAProxy binary Serve starts under ``epserve serve --ingress haproxy``: a filter on the
config Serve wrote, then the real binary.

Ray Serve 2.60 writes HAProxy's config from its own template and runs
``$RAY_SERVE_HAPROXY_BINARY_PATH -db -f <config> ...`` (its public override of the binary) on
every start and reload. ``epserve.deploy.haproxy_ingress`` points that variable at a small
script that runs this file (standard library only, so it starts in milliseconds) with the
real binary and epserve's settings, then Serve's arguments. Before handing over (``execv``,
same pid, same argv, so Serve's bookkeeping of its process holds) it rewrites the config in
place, under Serve's own lock of it:

- ``timeout http-request``: a request head must arrive within the header deadline (Serve's
  template leaves it unset, which falls back to ``timeout client``, 3600 s);
- ``http-request wait-for-body``: a body must arrive within the body deadline once its head
  has (HAProxy answers 408 and closes), so a replica gets whole bodies (up to the buffer,
  64 KiB; beyond that the rest streams and the replica's own deadline holds);
- ``errorfile`` for the errors HAProxy answers itself once a request is parsed (400, 403,
  408, 500, 502, 503, 504: OpenAI's error JSON, statuses kept) instead of Serve's text 500,
  and JSON for the default backend's 404;
- Serve's stats page and Prometheus exporter listen on 127.0.0.1, not every interface;
- the HTTP frontend listens on the address the user asked for (``--host``), while Serve itself
  is started on 127.0.0.1 so that what it binds there (the ingress replicas' own HTTP servers,
  its fallback proxy) stays on loopback: only HAProxy faces the network;
- a replica's 408 (a body that stalled) reaches the client with ``connection: close``
  (HAProxy drops the replica's own; ``timeout client`` then closes the connection).

It also asks the kernel to kill HAProxy when the process that started it (Serve's
HAProxyManager actor) dies, so HAProxy never outlives the server that owns it.

Invariants: a config without one of the places above (another Ray's template) is refused:
exit 2 with the reason on stderr, which Serve reports as HAProxy failing to start; a config
already rewritten is left as it is; arguments without ``-f`` (``-v``) go to HAProxy untouched.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import sys

MARK = "# rewritten by epserve/deploy/haproxy_edge.py"
#: The statuses HAProxy's HTTP analysers answer with a stream (the errorfiles apply there).
ERROR_CODES = (400, 403, 408, 500, 502, 503, 504)
_LOOPBACK_SECTIONS = ("frontend prometheus", "listen stats")
_BIND = re.compile(r"^(\s*bind\s+)(?:\*|0\.0\.0\.0|\[?::\]?)?:(\d+)(.*)$")
_HOST_PORT = re.compile(r"^(\s*bind\s+)\S*:(\d+)(\s.*)?$")
_NOT_FOUND = re.compile(r"^\s*http-request return status 404 ")
_PR_SET_PDEATHSIG = 1


class ShapeError(ValueError):
    """The config is not the one Ray 2.60's template writes."""


def _sections(lines: list[str]) -> dict[str, tuple[int, int]]:
    """Each section's header (``defaults``, ``frontend NAME``...) -> its lines [start, end)."""
    heads = [(i, line.strip()) for i, line in enumerate(lines)
             if line and not line[0].isspace() and not line.startswith("#")]
    return {name: (i, (heads[k + 1][0] if k + 1 < len(heads) else len(lines)))
            for k, (i, name) in enumerate(heads)}


def frontend_address(host: str) -> str:
    """What HAProxy's ``bind`` takes for ``--host`` (Serve's own mapping: every interface is
    ``*``)."""
    return "*" if host in ("0.0.0.0", "::", "") else host


def edge_config(text: str, header_timeout_ms: int, body_timeout_ms: int,
                error_dir: str, frontend_host: str | None = None) -> str:
    """Serve's config with epserve's edge settings (see the module's docstring);
    ``frontend_host``: the address the HTTP frontend binds instead of Serve's (None: Serve's)."""
    if MARK in text:
        return text
    lines = text.splitlines()
    sections = _sections(lines)
    for name in ("defaults", "frontend http_frontend", "backend default_backend",
                 *_LOOPBACK_SECTIONS):
        if name not in sections:
            raise ShapeError(f"no '{name}' section")
    out = list(lines)
    # 1. the loopback binds and the 404 (replacements in place: indices stay valid)
    for name in _LOOPBACK_SECTIONS:
        start, end = sections[name]
        binds = [i for i in range(start, end) if out[i].strip().startswith("bind ")]
        matched = [i for i in binds if _BIND.match(out[i])]
        if len(binds) != 1 or len(matched) != 1:
            raise ShapeError(f"'{name}' does not have exactly one 'bind [*]:PORT' line")
        out[matched[0]] = _BIND.sub(r"\g<1>127.0.0.1:\2\3", out[matched[0]])
    start, end = sections["backend default_backend"]
    found = [i for i in range(start, end) if _NOT_FOUND.match(out[i])]
    if len(found) != 1:
        raise ShapeError("'backend default_backend' has no single 404 'http-request return'")
    out[found[0]] = (f"    http-request return status 404 content-type application/json "
                     f"file {error_dir}/404.json")
    # 2. insertions, from the last section up: the 408's close, then the defaults (Serve's
    # errorfiles and any request timeout out, ours in after 'mode')
    start, end = sections["frontend http_frontend"]
    binds = [i for i in range(start, end) if out[i].strip().startswith("bind ")]
    if not binds or start < sections["defaults"][0]:
        raise ShapeError("'frontend http_frontend' has no 'bind' line, or precedes 'defaults'")
    if frontend_host is not None:  # in place, before the insertion below
        m = _HOST_PORT.match(out[binds[0]]) if len(binds) == 1 else None
        if m is None:
            raise ShapeError("'frontend http_frontend' does not have exactly one "
                             "'bind HOST:PORT' line")
        out[binds[0]] = (f"{m.group(1)}{frontend_address(frontend_host)}:{m.group(2)}"
                         f"{m.group(3) or ''}")
    out[binds[-1] + 1:binds[-1] + 1] = [
        f"    http-request wait-for-body time {int(body_timeout_ms)}ms",
        "    http-response set-header connection close if { status 408 }"]
    start, end = sections["defaults"]
    body = [line for line in out[start + 1:end]
            if not re.match(r"^\s*(errorfile\s|timeout\s+http-request\s)", line)]
    mode = [k for k, line in enumerate(body) if line.strip() == "mode http"]
    if not mode:
        raise ShapeError("'defaults' has no 'mode http'")
    ours = [f"    timeout http-request {int(header_timeout_ms)}ms"]
    ours += [f"    errorfile {code} {error_dir}/{code}.http" for code in ERROR_CODES]
    body[mode[0] + 1:mode[0] + 1] = ours
    out[start + 1:end] = body
    return "\n".join([MARK, *out]) + "\n"


def rewrite_in_place(path: str, header_timeout_ms: int, body_timeout_ms: int,
                     error_dir: str, frontend_host: str | None = None) -> None:
    """``edge_config`` on the file at ``path``, under the lock Serve writes it with."""
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            with open(path) as f:
                text = f.read()
            new = edge_config(text, header_timeout_ms, body_timeout_ms, error_dir,
                              frontend_host)
            if new != text:
                tmp = f"{path}.epserve.{os.getpid()}"
                with open(tmp, "w") as f:
                    f.write(new)
                os.replace(tmp, path)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process (HAProxy after the exec: the setting survives it) when its parent
    dies; if the parent is already gone, exit now."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        sys.exit(1)


def main(argv: list[str]) -> int:
    """``haproxy_edge.py REAL_BINARY HEADER_MS BODY_MS ERROR_DIR FRONTEND_HOST --
    HAPROXY_ARGS...``"""
    try:
        real, header_ms, body_ms, error_dir, host, sep, *args = argv
        if sep != "--":
            raise ValueError
        timeouts = int(header_ms), int(body_ms)
    except ValueError:
        print("usage: haproxy_edge.py REAL_BINARY HEADER_MS BODY_MS ERROR_DIR FRONTEND_HOST -- "
              "ARGS...", file=sys.stderr)
        return 2
    parent = os.getppid()
    if "-f" in args[:-1]:
        try:
            rewrite_in_place(args[args.index("-f") + 1], *timeouts, error_dir, host)
        except (OSError, ShapeError) as exc:
            print(f"epserve: the HAProxy config Ray Serve wrote is not the one epserve's edge "
                  f"was written for (Ray 2.60): {exc}", file=sys.stderr)
            return 2
    _die_with_parent(parent)
    os.execv(real, [real, *args])
    return 2  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
