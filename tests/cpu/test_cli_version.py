"""`epserve --version` and invalid option values, as a user runs the command (real
subprocesses): the version is the bare number, as `vllm --version` prints it; an invalid value
is one `epserve: error:` line on stderr and exit status 2 — no usage screen, no traceback — and
nothing is loaded or built first."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import epserve

TIMEOUT = 120


def _run(cache: Path, *args: str, script: bool = False) -> subprocess.CompletedProcess:
    if script:
        exe = Path(sys.executable).parent / "epserve"
        cmd = [str(exe) if exe.exists() else shutil.which("epserve") or "epserve"]
    else:
        cmd = [sys.executable, "-m", "epserve"]
    env = {**os.environ, "EPSERVE_CACHE_DIR": str(cache)}
    return subprocess.run(cmd + list(args), env=env, capture_output=True, text=True,
                          timeout=TIMEOUT, stdin=subprocess.DEVNULL)


@pytest.fixture
def cache(tmp_path) -> Path:
    """An empty cache folder: a run that failed on its options left it empty."""
    d = tmp_path / "cache"
    d.mkdir()
    return d


@pytest.mark.parametrize("flag", ["--version", "-v"])
@pytest.mark.parametrize("script", [False, True])
def test_version_prints_the_package_version(cache, flag, script):
    proc = _run(cache, flag, script=script)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{epserve.__version__}\n"
    assert proc.stderr == ""


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("epserve: error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize("port", ["99999", "0", "-1", "abc", "80.5"])
def test_an_invalid_port_is_one_line_and_status_2(cache, port):
    line = _one_line(_run(cache, "serve", "--port", port, script=True))
    assert "--port" in line and repr(port) in line and "65535" in line
    assert "epserve serve --help" in line
    assert not any(cache.iterdir()), "the demo model was built before the option was checked"


@pytest.mark.parametrize("args, want", [
    (["serve", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    (["serve", "--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value"),
    (["serve", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["generate"], "the following arguments are required: prompt"),
    ([], "the following arguments are required: command"),
])
def test_usage_errors_are_one_line_too(cache, args, want):
    line = _one_line(_run(cache, *args))
    assert want in line, line
    assert not any(cache.iterdir())


def test_a_value_the_server_refuses_is_one_line(cache):
    """Past argparse: the server's own checks of a value answer the same way."""
    line = _one_line(_run(cache, "serve", "--max-body-bytes", "-5"))
    assert "max_body_bytes" in line and "-5" in line
