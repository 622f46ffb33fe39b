"""What bench/serve.py sets up: the workload's prompts, the Qwen3-30B-A3B-shape folder (dummy
weights, a word-level tokenizer), the engine options shared by the server and the offline
``LLM``, the ``epserve serve`` subprocess, and the offline run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from serve_client import Req

# (flag, type): engine options passed to both `epserve serve` and LLM(...) when given
ENGINE_OPTIONS = [("--dtype", str), ("--device", str), ("--max-num-seqs", int),
                  ("--max-num-batched-tokens", int), ("--max-model-len", int),
                  ("--num-kv-blocks", int), ("--gpu-memory-utilization", float),
                  ("--ep-size", int), ("--load-format", str)]
ENGINE_SWITCHES = ["--enforce-eager", "--no-prefix-caching"]
SALT_OFFLINE, SALT_PREFILL = 0, 1  # offline prompts = the first HTTP run's (salt 0)


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("engine options (server and offline LLM alike; default: "
                              "epserve's own)")
    for flag, typ in ENGINE_OPTIONS:
        g.add_argument(flag, type=typ, default=None)
    for flag in ENGINE_SWITCHES:
        g.add_argument(flag, action="store_true")
    g.add_argument("--api-server-count", type=int, default=None,
                   help="server only; refused when `epserve serve` has no such flag")
    g.add_argument("--ingress", choices=["auto", "haproxy", "proxy"], default=None,
                   help="server only: `epserve serve --ingress` (default: its own, auto)")


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw = {_dest(f): getattr(args, _dest(f)) for f, _ in ENGINE_OPTIONS
          if getattr(args, _dest(f)) is not None}
    if args.enforce_eager:
        kw["enforce_eager"] = True
    if args.no_prefix_caching:
        kw["enable_prefix_caching"] = False
    return kw


def server_flags(args: argparse.Namespace) -> list[str]:
    out = []
    for flag, _ in ENGINE_OPTIONS + [("--api-server-count", int), ("--ingress", str)]:
        if getattr(args, _dest(flag)) is not None:
            out += [flag, str(getattr(args, _dest(flag)))]
    return out + [f for f in ENGINE_SWITCHES if getattr(args, _dest(f))]


# ----------------------------------------------------------------------------- workload

def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def salted(prompts: list[list[int]], salt: int, vocab: int) -> list[list[int]]:
    """The prompts with their first token shifted by ``salt``: the same lengths and costs, but
    no KV block shared with another salt's, so one run never hits the prefix cache another
    filled (the cache is keyed by whole blocks from the start)."""
    return [[10 + (p[0] - 10 + salt) % (vocab - 10)] + p[1:] for p in prompts]


def load_dataset(path: str, limit: int | None) -> list[Req]:
    """A JSONL of {"prompt": text, "max_tokens": n}, one request a line."""
    reqs = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        obj = json.loads(line)
        if not isinstance(obj.get("prompt"), str) or not isinstance(obj.get("max_tokens"), int):
            raise ValueError(f"{path}:{i + 1}: expected {{'prompt': str, 'max_tokens': int}}")
        reqs.append(Req(obj["prompt"], obj["max_tokens"]))
    return reqs[:limit] if limit else reqs


def model_vocab(folder: str | None) -> int | None:
    cfg = Path(folder or "") / "config.json"
    return json.loads(cfg.read_text())["vocab_size"] if folder and cfg.is_file() else None


def load_tokenizer(folder: str | None) -> Any:
    if not folder or not (Path(folder) / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


# ----------------------------------------------------------------------------- model folders

def shape_folder(cfg: dict[str, Any]) -> Path:
    """A checkpoint folder of ``cfg`` without weights (serve it with load_format=dummy) and a
    word-level tokenizer of the model's whole vocabulary ("w0" ... "w<V-1>", split on
    whitespace), so any token ids decode to text that encodes back to them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = Path(tempfile.mkdtemp(prefix="epserve-bench-serve-"))
    (folder / "config.json").write_text(json.dumps(cfg))
    vocab = {f"w{i}": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "w0",
        "model_max_length": cfg.get("max_position_embeddings", 4096),
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    return folder


# ----------------------------------------------------------------------------- the server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_serve_flag(flag: str) -> None:
    """ValueError unless ``epserve serve --help`` lists ``flag``."""
    out = subprocess.run([sys.executable, "-m", "epserve", "serve", "--help"],
                         capture_output=True, text=True, timeout=120).stdout
    if flag not in out:
        raise ValueError(f"{flag}: this epserve's `serve` command has no such option")


@contextlib.contextmanager
def server(model_flags: list[str], flags: list[str], timeout_s: float,
           grace_s: float = 60.0) -> Iterator[tuple[str, str]]:
    """``epserve serve`` on 127.0.0.1 and a free port with a fresh API key, until the block
    ends: yields (base URL, key) once /health answers 200. Its output goes to a log file whose
    tail is printed when it fails to start. Stopped with SIGINT, then SIGKILL to its process
    group after ``grace_s``."""
    import requests

    port, key = free_port(), secrets.token_hex(16)
    log = Path(tempfile.mkstemp(prefix="epserve-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "epserve", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--api-key", key, *model_flags, *flags]
    print(f"[server] {' '.join(cmd[1:]).replace(key, '<key>')} (log: {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before "
                                   f"/health answered:\n{tail(log)}")
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"/health did not answer 200 within {timeout_s:.0f} s:\n"
                                   f"{tail(log)}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        print(f"[server] healthy after {time.perf_counter() - t0:.1f} s at {base}", flush=True)
        yield base, key
    finally:
        _stop(proc, grace_s)


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            print(f"[server] still running {grace_s:.0f} s after SIGINT: SIGKILL", flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
            proc.wait()


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


# ----------------------------------------------------------------------------- offline

def _generate(llm: Any, endpoint: str, reqs: list[Req]) -> tuple[float, list[int]]:
    """Wall seconds from submission to the last token, and each request's token count."""
    import torch

    from epserve import SamplingParams

    sps = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
           for r in reqs]
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if endpoint == "chat":
        outs = llm.chat([[{"role": "user", "content": r.prompt}] for r in reqs], sps)
    else:
        outs = llm.generate([{"prompt_token_ids": r.prompt} if isinstance(r.prompt, list)
                             else r.prompt for r in reqs], sps)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, [len(o.outputs[0].token_ids) for o in outs]


def run_offline(model: str | None, kwargs: dict[str, Any], endpoint: str, reqs: list[Req],
                warm: list[Req], prefill: list[Req], threads: int | None) -> dict[str, Any]:
    """The workload through ``LLM.generate`` (or ``LLM.chat``) in this process: a warm-up,
    the batch with max_tokens=1 (other prompts of the same lengths: the time to the first
    decode step), then the timed batch, on ``threads`` torch threads (None: torch's
    default); the engine is freed before returning."""
    import torch

    from epserve import LLM

    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads or old_threads)
    t0 = time.perf_counter()
    llm = LLM(model=model, **kwargs)
    load_s = time.perf_counter() - t0
    try:
        _generate(llm, endpoint, warm)
        prefill_s, _ = _generate(llm, endpoint, prefill)
        wall, got = _generate(llm, endpoint, reqs)
    finally:
        llm.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        torch.set_num_threads(old_threads)
    bad = sum(g != r.max_tokens for g, r in zip(got, reqs))
    steps = max(1, max(got, default=1) - 1)  # decode steps after the batch's first token
    return {"decode_step_s": max(0.0, wall - prefill_s) / steps,
            "load_s": load_s, "wall_s": wall, "out_tokens": sum(got),
            "out_tok_s": sum(got) / wall, "prefill_s": prefill_s, "mismatches": bad,
            "threads": threads or old_threads}
