"""Serving benchmark (issue 19), in the shape of ``vllm bench serve``: the same workload over
HTTP (``/v1/completions`` or ``/v1/chat/completions``) and offline (``LLM.generate``), one run.

Workload: ``--num-prompts`` random token-id prompts of ``--input-len`` tokens (seeded), greedy,
EOS ignored, ``max_tokens = --output-len``; or ``--dataset FILE`` (JSONL of {"prompt": text,
"max_tokens": n}). Each HTTP run (every ``--mode`` x load) first sends a short warm-up, then
the workload with its first token shifted by the run's index, so no run hits the prefix cache
another filled (the offline batch uses run 0's prompts). Load: ``--max-concurrency N ...``
(N in flight) and/or ``--request-rate R ...`` (Poisson arrivals, R/s; inf = all at once).
A streamed request asks for usage and ``return_token_ids``, so tokens per chunk are exact.
The server: ``--url`` of a running one, or ``epserve serve`` started here on a free port
(``--model demo``: the built-in demo model; ``--model-shape qwen3-30b-a3b``: that config with
random weights and a word-level tokenizer) after the offline run in this process, which uses
the same engine options and submits every prompt at once, whatever the HTTP load. TPOT =
(e2e - ttft) / (tokens - 1); ITL = the gap between chunks that carry tokens; "offline
prefill" = ``LLM.generate`` of the same batch with max_tokens=1. Each run's details (mean /
p50 / p90 / p99, the machine's load average, the client's CPU time, the server's /metrics
counters) come before the setup line and the table, which is printed last. On a shared 2-core
VM pass ``--offline-threads 1``: with 2 torch threads the offline run collapses (10-50x)
whenever another process wants a core. There the HTTP figure also depends on whether the
vCPUs sit idle (a ``nice -n 19`` busy loop beside the run has doubled it): compare two trees
in alternating runs under the same condition.

    python bench/serve.py --num-prompts 64 --input-len 64 --output-len 32 \\
        --max-concurrency 64 --mode stream nonstream --offline-threads 1   # CPU, demo model
    python bench/serve.py --model-shape qwen3-30b-a3b --max-concurrency 32 256 \\
        --mode stream nonstream                                            # GPU, 256 x 256->128
    python bench/serve.py --url http://127.0.0.1:8000 --api-key KEY --skip-offline \\
        --num-prompts 4 --input-len 8 --output-len 4 --max-concurrency 2
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_setup as S  # noqa: E402
from serve_client import Req, run_load, summarize  # noqa: E402

SHAPES = ("qwen3-30b-a3b",)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (http://host:port); default: start one")
    ap.add_argument("--api-key", default=os.environ.get("EPSERVE_API_KEY"))
    ap.add_argument("--model", default="demo", help="'demo' (built-in) or a checkpoint folder")
    ap.add_argument("--model-shape", choices=SHAPES, help="random weights of this shape")
    ap.add_argument("--layers", type=int, default=48, help="layers of --model-shape")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--dataset", help="JSONL of {'prompt': text, 'max_tokens': n}")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--max-concurrency", type=int, nargs="+", help="requests in flight")
    ap.add_argument("--request-rate", type=float, nargs="+", help="Poisson arrivals per s")
    ap.add_argument("--mode", nargs="+", choices=["stream", "nonstream"], default=["stream"])
    ap.add_argument("--stream", dest="mode", action="store_const", const=["stream"])
    ap.add_argument("--no-stream", dest="mode", action="store_const", const=["nonstream"])
    ap.add_argument("--warmup-requests", type=int, default=8)
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--offline-threads", type=int,
                    help="torch threads of the offline run (default: torch's); 1 on a busy "
                         "2-core VM, where 2 threads collapse when another process runs")
    ap.add_argument("--server-timeout", type=float, default=900.0, help="s to wait for /health")
    S.add_engine_args(ap)
    args = ap.parse_args(argv)
    if args.model_shape and args.model != "demo":
        ap.error("--model-shape builds its own folder: leave --model out")
    if args.url and not args.url.startswith(("http://", "https://")):
        ap.error("--url must start with http:// or https://")
    return args


def loads(args: argparse.Namespace) -> list[tuple[int | None, float]]:
    """(concurrency cap or None, rate) per run: every concurrency x every rate."""
    concs = args.max_concurrency or [None]
    rates = args.request_rate or [math.inf]
    return [(c, r) for c in concs for r in rates]


def load_label(conc: int | None, rate: float) -> str:
    parts = ([f"c={conc}"] if conc else []) + ([f"{rate:g}/s"] if math.isfinite(rate) else [])
    return ", ".join(parts) or "all at once"


def resolve_model(args: argparse.Namespace) -> tuple[str | None, str | None, list[str]]:
    """(local folder for vocab and tokenizer, LLM's model argument, serve's --model flags)."""
    if args.model_shape:
        from decode_latency import QWEN3_30B_A3B  # imports epserve's LLM

        folder = str(S.shape_folder(dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)))
        if args.load_format is None:
            args.load_format = "dummy"
        return folder, folder, ["--model", folder]
    if args.model == "demo":
        from epserve.models.demo import demo_model_path

        return str(demo_model_path()), None, []
    return args.model, args.model, ["--model", args.model]


class Workload:
    """The requests of each run: ``make(salt)`` for the timed batch, ``warm()`` for warm-ups."""

    def __init__(self, args: argparse.Namespace, folder: str | None):
        self.args = args
        self.vocab = S.model_vocab(folder)
        self.tok = S.load_tokenizer(folder) if args.endpoint == "chat" else None
        self.dataset = S.load_dataset(args.dataset, args.num_prompts) if args.dataset else None
        if self.dataset is None and self.vocab is None:
            raise ValueError(f"no config.json in {folder!r}: random prompts need the model's "
                             f"vocabulary size (pass --model FOLDER)")
        if args.endpoint == "chat" and self.dataset is None and self.tok is None:
            raise ValueError("--endpoint chat with random prompts needs the model's tokenizer")

    def _reqs(self, ids: list[list[int]], max_tokens: int) -> list[Req]:
        if self.tok is None:
            return [Req(p, max_tokens) for p in ids]
        hi = min(self.vocab, len(self.tok))
        return [Req(self.tok.decode([10 + (t - 10) % (hi - 10) for t in p]), max_tokens)
                for p in ids]

    def make(self, salt: int, max_tokens: int | None = None) -> list[Req]:
        a = self.args
        if self.dataset is not None:
            return [Req(r.prompt, max_tokens or r.max_tokens) for r in self.dataset]
        base = S.random_prompts(a.num_prompts, a.input_len, self.vocab, a.seed)
        return self._reqs(S.salted(base, salt, self.vocab), max_tokens or a.output_len)

    def warm(self, salt: int, n: int) -> list[Req]:
        a = self.args
        if self.dataset is not None:
            return [Req(r.prompt, min(4, r.max_tokens)) for r in self.dataset[-n:]]
        base = S.random_prompts(n, a.input_len, self.vocab, a.seed + 1)
        return self._reqs(S.salted(base, salt, self.vocab), min(4, a.output_len))

    def describe(self) -> str:
        a = self.args
        if self.dataset is not None:
            return f"{len(self.dataset)} prompts from {a.dataset}"
        kind = "random token ids" if self.tok is None else "random ids decoded to text"
        return f"{a.num_prompts} prompts x {a.input_len} -> {a.output_len} tokens ({kind}, " \
               f"seed {a.seed})"


def served_model(base: str, key: str | None) -> tuple[str, str | None]:
    """The served model's name and its folder (root) from /v1/models."""
    import requests

    try:
        r = requests.get(f"{base}/v1/models", timeout=30,
                         headers={"Authorization": f"Bearer {key}"} if key else {})
    except requests.RequestException as exc:
        raise RuntimeError(f"{base}/v1/models: {type(exc).__name__}") from None
    if r.status_code != 200:
        raise RuntimeError(f"{base}/v1/models answered {r.status_code}: {r.text[:200]}")
    data = r.json()["data"][0]
    return data["id"], data.get("root")


def run_http(args: argparse.Namespace, work: Workload, base: str, key: str | None,
             model: str) -> list[dict[str, Any]]:
    """Every mode x load against one server, each after a warm-up; a summary per run."""
    rows = []
    for mode in args.mode:
        for conc, rate in loads(args):
            salt = len(rows)
            label = f"[{mode} {load_label(conc, rate)}]"
            n_warm = min(args.warmup_requests, conc or args.warmup_requests)
            if n_warm:
                asyncio.run(run_load(base, key, model, args.endpoint, work.warm(salt, n_warm),
                                     mode == "stream", conc, math.inf))
            load0, cpu0, m0 = os.getloadavg()[0], time.process_time(), scrape(base, key)
            records, wall = asyncio.run(run_load(base, key, model, args.endpoint,
                                                 work.make(salt), mode == "stream", conc, rate,
                                                 seed=args.seed))
            s = summarize(records, wall)
            m1 = scrape(base, key)
            s.update(mode=mode, load=load_label(conc, rate), loadavg=(load0, os.getloadavg()[0]),
                     client_cpu=time.process_time() - cpu0,
                     server={k: m1[k] - m0[k] for k in m1.keys() & m0.keys()})
            print(detail(label, s), flush=True)
            rows.append(s)
    return rows


def scrape(base: str, key: str | None) -> dict[str, float]:
    """The server's counters of interest from /metrics (summed over labels); {} on failure."""
    import requests

    names = ("vllm:num_preemptions", "vllm:generation_tokens", "vllm:prompt_tokens")
    out: dict[str, float] = {}
    try:
        r = requests.get(f"{base}/metrics", timeout=30,
                         headers={"Authorization": f"Bearer {key}"} if key else {})
        for line in r.text.splitlines() if r.status_code == 200 else []:
            name = line.split("{")[0].split(" ")[0].removesuffix("_total")
            if name in names and not line.startswith("#"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    except (requests.RequestException, ValueError):
        return {}
    return out


def _ms(st: dict[str, float | None]) -> str:
    return "/".join("-" if st[k] is None else f"{st[k]:.1f}" for k in ("mean", "p50", "p90", "p99"))


def detail(label: str, s: dict[str, Any]) -> str:
    lines = [f"{label} {s['ok']}/{s['n']} ok in {s['wall_s']:.2f} s: {s['req_s']:.2f} req/s, "
             f"{s['out_tok_s']:.1f} out tok/s, {s['total_tok_s']:.1f} total tok/s; "
             f"ms mean/p50/p90/p99: E2E {_ms(s['e2e'])}; machine load average "
             f"{s['loadavg'][0]:.1f} -> {s['loadavg'][1]:.1f}; client CPU "
             f"{s['client_cpu']:.2f} s"]
    if s["server"]:
        lines.append("  server /metrics during the run: " + ", ".join(
            f"{k.removeprefix('vllm:')} +{v:.0f}" for k, v in sorted(s["server"].items())))
    if s["mode"] == "stream":
        lines.append(f"  TTFT {_ms(s['ttft'])}; TPOT {_ms(s['tpot'])}; ITL {_ms(s['itl'])}; "
                     f"{s['chunks']} chunks with tokens ({fmt(s['chunks_s'], '.1f')}/s, "
                     f"{fmt(s['tok_per_chunk'], '.2f')} tokens each"
                     f"{'' if s['exact_counts'] else ', counted as 1: no token_ids'}); "
                     f"mean ITL over each request's first / last quarter of chunks "
                     f"{fmt(s['itl_q1'], '.1f')} / {fmt(s['itl_q4'], '.1f')} ms")
    if s["errors"]:
        lines.append(f"  errors: {s['first_errors']}")
    if s["mismatches"]:
        lines.append(f"  mismatched (tokens, usage): {s['token_counts']}")
    return "\n".join(lines)


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict[str, Any]], offline: dict[str, Any] | None) -> list[str]:
    out = ["| mode | load | req/s | out tok/s | offline tok/s | HTTP/offline | TTFT p50 ms "
           "| TTFT p99 ms | TPOT p50 ms | ITL p50 ms | ITL p99 ms | E2E p50 ms | chunks/s "
           "| tokens/chunk | errors | mismatches |",
           "|---|---|" + "---:|" * 14]
    off = offline["out_tok_s"] if offline else None
    for s in rows:
        st = s["mode"] == "stream"
        cells = [s["mode"], s["load"], f"{s['req_s']:.2f}", f"{s['out_tok_s']:.1f}",
                 fmt(off, ".1f"), f"{s['out_tok_s'] / off:.2f}" if off else "-",
                 fmt(s["ttft"]["p50"] if st else None, ".1f"),
                 fmt(s["ttft"]["p99"] if st else None, ".1f"),
                 fmt(s["tpot"]["p50"] if st else None, ".2f"),
                 fmt(s["itl"]["p50"] if st else None, ".2f"),
                 fmt(s["itl"]["p99"] if st else None, ".2f"), fmt(s["e2e"]["p50"], ".1f"),
                 fmt(s["chunks_s"] if st else None, ".1f"),
                 fmt(s["tok_per_chunk"] if st else None, ".2f"), str(s["errors"]),
                 str(s["mismatches"])]
        out.append("| " + " | ".join(cells) + " |")
    return out


def offline_line(off: dict[str, Any] | None) -> str:
    if off is None:
        return "offline: skipped"
    bad = f", {off['mismatches']} MISMATCHED" if off["mismatches"] else ""
    return (f"offline LLM.generate ({off['threads']} torch threads): load "
            f"{off['load_s']:.1f} s, wall {off['wall_s']:.2f} s, "
            f"{off['out_tok_s']:.1f} out tok/s, prefill of the batch (max_tokens=1) "
            f"{1e3 * off['prefill_s']:.1f} ms, mean decode step after it "
            f"{1e3 * off['decode_step_s']:.2f} ms{bad} (machine load average "
            f"{off['loadavg'][0]:.1f} -> {off['loadavg'][1]:.1f})")


def _needs(args: argparse.Namespace) -> str | None:
    """The missing package's message, when one this run needs is absent (a GPU machine
    without Ray can run --url --skip-offline only)."""
    need = ["aiohttp", "requests"] + ([] if args.url else ["ray"])
    for mod in need:
        if importlib.util.find_spec(mod) is None:
            why = "to start the server (or pass --url)" if mod == "ray" else "for the client"
            return f"error: {mod!r} is not installed; bench/serve.py needs it {why}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if (msg := _needs(args)) is not None:
        print(msg, file=sys.stderr)
        return 2
    try:
        return _bench(args)
    except (ValueError, RuntimeError) as exc:  # bad input, a server that did not start
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _bench(args: argparse.Namespace) -> int:
    if args.api_server_count is not None and not args.url:
        S.check_serve_flag("--api-server-count")
    t_start = time.perf_counter()
    base = key = model = None
    if args.url:
        base, key = args.url.rstrip("/").removesuffix("/v1"), args.api_key
        model, root = served_model(base, key)
        folder, llm_model, model_flags = (root, root, []) if args.model == "demo" \
            else resolve_model(args)
    else:
        folder, llm_model, model_flags = resolve_model(args)
    try:
        work = Workload(args, folder)
        offline = None if args.skip_offline else _offline(args, work, llm_model)
        if args.url:
            rows = run_http(args, work, base, key, model)
        else:
            with S.server(model_flags, S.server_flags(args), args.server_timeout) as (base, key):
                model, _ = served_model(base, key)
                rows = run_http(args, work, base, key, model)
    finally:
        if args.model_shape:  # the folder this run built (config + tokenizer, no weights)
            shutil.rmtree(folder, ignore_errors=True)
    shape = f"{args.model_shape} ({args.layers} layers, dummy weights)" if args.model_shape \
        else model
    started = f"epserve serve --ingress {args.ingress or 'auto'} (started here)"
    print(f"\nmodel {shape}; {args.endpoint}; {work.describe()}; greedy, EOS ignored; server "
          f"{args.url or started}; engine options "
          f"{json.dumps(S.llm_kwargs(args))}; {offline_line(offline)}; "
          f"total run {time.perf_counter() - t_start:.0f} s")
    if offline:
        print("TTFT p50 against the offline prefill of the batch: " + "; ".join(
            f"{s['load']} {s['ttft']['p50']:.1f} ms = {s['ttft']['p50'] / off_ms:.2f}x"
            for s in rows if s["mode"] == "stream" and s["ttft"]["p50"] is not None
            for off_ms in [1e3 * offline["prefill_s"]]))
        print("ITL p50 against the offline mean decode step: " + "; ".join(
            f"{s['load']} {s['itl']['p50']:.2f} ms = {s['itl']['p50'] / step_ms:.2f}x"
            for s in rows if s["mode"] == "stream" and s["itl"]["p50"] is not None
            for step_ms in [1e3 * offline["decode_step_s"]]))
    print("\n".join(table(rows, offline)))
    return 0


def _offline(args: argparse.Namespace, work: Workload, llm_model: str | None) -> dict[str, Any]:
    load0 = os.getloadavg()[0]
    offline = S.run_offline(llm_model, S.llm_kwargs(args), args.endpoint, work.make(0),
                            work.warm(0, args.warmup_requests),
                            work.make(S.SALT_PREFILL, max_tokens=1), args.offline_threads)
    offline["loadavg"] = (load0, os.getloadavg()[0])
    print(offline_line(offline), flush=True)
    return offline


if __name__ == "__main__":
    sys.exit(main())
