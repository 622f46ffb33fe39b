"""`epserve serve` (``serve_main``) in a subprocess, as a user starts it in a terminal, and
stopped as a terminal stops it (Ctrl-C); the regexes of what its terminal shows."""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys

from serverkit import wait_for

_MAIN = """
import sys
from epserve.deploy.cli import _parser
from epserve.deploy.server import serve_main
sys.exit(serve_main(_parser().parse_args(sys.argv[1:])))
"""


# "(HeadActor pid=N) <time> epserve.head.async_engine ..." (head_actor's logging format)
HEAD_LINE = r"^\(HeadActor pid=\d+\) \S+ \S+ epserve\.head\.async_engine "
PERIODIC = re.compile(HEAD_LINE + r"engine loop: prompt throughput [\d.]+ tokens/s, generation "
                      r"throughput [\d.]+ tokens/s, running \d+, waiting \d+, KV cache usage "
                      r"[\d.]+%", re.M)


def log_every_s() -> float:
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
