"""The ``epserve`` command as a user runs it: ``python -m epserve`` and the console script.

Every call is a real subprocess with ``EPSERVE_CACHE_DIR`` pointing at this session's demo
model build (nothing is built or downloaded in the user's home), and a 120 s timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from epserve import LLM, SamplingParams

TIMEOUT = 120


def _console_script() -> str:
    exe = Path(sys.executable).parent / "epserve"
    found = str(exe) if exe.exists() else shutil.which("epserve")
    if not found:
        pytest.fail("the `epserve` console script is not installed next to this Python")
    return found


@pytest.fixture(scope="module")
def env(demo_model_dir) -> dict[str, str]:
    import torch

    e = dict(os.environ)
    e["EPSERVE_CACHE_DIR"] = str(demo_model_dir.parent)
    e.pop("CUDA_VISIBLE_DEVICES", None)
    # the test process's torch threads (tests/conftest.py: half the cores, one on the 2-core
    # CI VM): a command runs beside this process and the next command, and with two threads
    # each tiny op's barrier waits for a core another process holds (a generate run took
    # 8.1 s with two threads, 2.6 s with one, on the 2-core VM under load)
    e["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    return e


def _start(env, *args: str, script: bool = False) -> subprocess.Popen:
    """The command running (its output collected by ``_done``): the tests start a command,
    then compute what it must print meanwhile."""
    cmd = [_console_script()] if script else [sys.executable, "-m", "epserve"]
    return subprocess.Popen(cmd + list(args), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def _done(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _run(env, *args: str, script: bool = False) -> subprocess.CompletedProcess:
    return _done(_start(env, *args, script=script))


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The run failed as promised: status 2, nothing on stdout, one 'epserve: error:' line."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("epserve: error: "), proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def demo(demo_model_dir) -> LLM:
    return LLM(model=str(demo_model_dir), seed=0)


def test_generate_prints_the_greedy_text_of_the_api(env, demo):
    first = _start(env, "generate", "--max-tokens", "8", "Hello")
    # The console script is the same command, greedy output does not change between runs, and
    # the decode lookahead changes no token (one run checks all three).
    second = _start(env, "generate", "--no-decode-lookahead", "--max-tokens", "8", "Hello",
                    script=True)
    want = demo.generate("Hello", SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    first, second = _done(first), _done(second)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip()
    assert len(want.token_ids) == 8 or want.finish_reason == "stop"
    assert first.stdout == want.text + "\n"
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout


def test_generate_with_stop_and_sampling_options(env, demo):
    sampled_run = _start(env, "generate", "--max-tokens", "12", "--ignore-eos", "--temperature",
                         "0.9", "--top-p", "0.95", "--top-k", "50", "--sample-seed", "5",
                         "Once upon a time", script=True)
    base = demo.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=24,
                                                            ignore_eos=True))[0].outputs[0].text
    stop = base[12:15]
    stop_run = _start(env, "generate", "--max-tokens", "24", "--ignore-eos", "--stop", stop,
                      "Once upon a time")
    want = demo.generate("Once upon a time", SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))[0].outputs[0]
    sampled = demo.generate("Once upon a time", SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=5, max_tokens=12, ignore_eos=True))[0]
    proc = _done(stop_run)
    assert want.finish_reason == "stop"
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want.text + "\n"
    proc = _done(sampled_run)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == sampled.outputs[0].text + "\n"


def test_generate_chat_uses_the_chat_template(env, demo):
    run = _start(env, "generate", "--chat", "--max-tokens", "8", "Hello")
    want = demo.chat([{"role": "user", "content": "Hello"}],
                     SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    proc = _done(run)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want.text + "\n"


BAD_OPTIONS = [
    (["--temperature", "-1"], "SamplingParams.temperature"),
    (["--max-tokens", "0"], "SamplingParams.max_tokens"),
    (["--top-p", "0"], "SamplingParams.top_p"),
    (["--ep-size", "3"], "num_experts=16 is not divisible by world_size=3"),
    (["--device", "foo"], "device='foo'"),
    (["--block-size", "0"], "block_size must be a positive integer"),
]


@pytest.fixture(scope="module")
def refused(env, qwen3_ckpt, tmp_path_factory) -> dict:
    """The commands the tests below expect refused, started together when the first of those
    tests runs (each spends ~1.5 s importing before it fails; this process computes on one
    core); each test reads its own command's outcome."""
    missing = tmp_path_factory.mktemp("cli") / "nonexistent"
    runs = {
        "no tokenizer": (qwen3_ckpt, _start(env, "generate", "--model", str(qwen3_ckpt),
                                            "Hello")),
        "missing folder": (missing, _start(env, "generate", "--model", str(missing), "Hello",
                                           script=True)),
        "empty prompt": (None, _start(env, "generate", "--max-tokens", "4", "")),
        "serve missing model": (None, _start(env, "serve", "--model", "/nonexistent/ckpt",
                                             script=True)),
    }
    for args, _ in BAD_OPTIONS:
        runs[" ".join(args)] = (None, _start(env, "generate", *args, "Hello"))
    yield runs
    for _, proc in runs.values():
        if proc.poll() is None:  # a test failed before reading it
            proc.kill()
            proc.communicate()


def test_text_prompt_on_a_checkpoint_without_tokenizer(refused):
    ckpt, proc = refused["no tokenizer"]
    line = _one_error_line(_done(proc))
    assert str(ckpt) in line and "no tokenizer" in line and "--tokenizer" in line


@pytest.mark.parametrize("args, want", BAD_OPTIONS)
def test_bad_option_exits_2_naming_it(refused, args, want):
    line = _one_error_line(_done(refused[" ".join(args)][1]))
    assert want in line


def test_missing_model_folder_exits_2_naming_it(refused):
    missing, proc = refused["missing folder"]
    line = _one_error_line(_done(proc))
    assert str(missing) in line


def test_empty_prompt_exits_2(refused):
    line = _one_error_line(_done(refused["empty prompt"][1]))
    assert "prompt" in line and "empty" in line


def test_serve_with_a_missing_model_exits_2_naming_it(refused):
    line = _one_error_line(_done(refused["serve missing model"][1]))
    assert "/nonexistent/ckpt" in line


def test_usage_errors_are_argparse_status_2(env):
    proc = _run(env, "generate")
    assert proc.returncode == 2 and "prompt" in proc.stderr and proc.stdout == ""
    proc = _run(env, "generate", "--help")
    assert proc.returncode == 0 and "--max-tokens" in proc.stdout and "--chat" in proc.stdout
