"""Offline throughput (issue 6): the same batch workloads on epserve and on transformers
continuous batching (``generate_batch``, paged attention; ``generate`` on one static batch for a
gated-DeltaNet hybrid, which its continuous batching refuses), one process, one GPU, one run.

Workloads: ``short`` = 256 requests x 256 prompt tokens -> 128 output tokens; ``long`` = 256
x 1024 -> 256. Prompts are deterministic random token ids; both engines decode greedily with
EOS off, so every request makes exactly the asked number of tokens (counted from the outputs
and checked). Shapes default to Qwen3-30B-A3B with random bf16 weights (epserve:
``load_format="dummy"``). transformers runs first (model freed: del + gc + empty_cache), then
epserve. Each engine gets a small warm-up batch (other prompts) before each timed workload;
wall time runs from submission to the last token. "mean step ms" = wall / engine steps
(epserve only). "floor" = out_len decode steps, each reading the weights a batch of B routes to
(``active_bytes`` with top-k replaced by the expected distinct experts E(1-(1-k/E)^B)), at
``--hbm-gbps``; prefill and KV reads are left out, so it is a lower bound. Table printed last.

    python bench/throughput.py [--workload short long] [--layers 48] [--skip-transformers]
    python bench/throughput.py --tiny --device cpu --workload short --requests 8   # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch


def _no_ray(exc: ModuleNotFoundError) -> bool:
    """True (after a clear message) when epserve's single-GPU path needed Ray or pydantic."""
    if (exc.name or "").split(".")[0] not in ("ray", "pydantic"):
        return False
    print(f"error: epserve's LLM(ep_size=1) path imported {exc.name!r}, which is not installed "
          f"here; the single-GPU path should not need it (report it)", file=sys.stderr)
    return True


sys.path.insert(0, str(Path(__file__).resolve().parent))
try:  # decode_latency imports epserve's LLM
    from decode_latency import QWEN3_30B_A3B, active_bytes  # noqa: E402
    from shapes import SHAPES, shape  # noqa: E402
    from throughput_hf import (WARM_REQUESTS, WARM_TOKENS, Result, prompts,  # noqa: E402
                               run_transformers, run_transformers_generate, sync)
except ModuleNotFoundError as _exc:
    if _no_ray(_exc):
        sys.exit(2)
    raise

WORKLOADS = {"short": (256, 256, 128), "long": (256, 1024, 256)}  # requests, in, out
TINY = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=96,
            moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)
def floor_s(cfg: dict, batch: int, out_len: int, gbps: float) -> float:
    e, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    touched = e * (1.0 - (1.0 - k / e) ** batch)
    return out_len * active_bytes(dict(cfg, num_experts_per_tok=touched)) / (gbps * 1e9)


def _hybrid(cfg: dict) -> bool:
    return "linear_attention" in cfg.get("layer_types", ())


@contextlib.contextmanager
def _compile_log(name: str, t0: float):
    """Print every Triton kernel compiled (or loaded from the disk cache) inside the block: a
    timed run should compile nothing, the warm-up and graph capture having seen every shape."""
    try:
        from triton import knobs
    except ImportError:  # no triton: nothing compiles
        yield
        return

    def hook(*, repr, **_):  # noqa: A002 - the hook's keyword
        print(f"[epserve {name}] Triton compile at +{time.perf_counter() - t0:.2f} s: "
              f"{repr[:300]}", flush=True)

    old, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, hook
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = old


def run_epserve(cfg: dict, work: dict, args, dtype: str) -> list[Result]:
    from epserve import LLM, SamplingParams

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(cfg))
    max_len = max(i + o for _, i, o in work.values())
    extra = {"enforce_eager": True} if args.enforce_eager else {}
    t0 = time.perf_counter()
    llm = LLM(model=str(folder), dtype=dtype, load_format="dummy", device=args.device,
              max_model_len=max_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=not args.no_prefix_caching,
              num_kv_blocks=args.num_kv_blocks, **extra)
    model = llm.model
    runner = model.runner  # the device side: KV blocks, graphs
    graphs = getattr(runner, "graphs", None)
    print(f"[epserve] load {time.perf_counter() - t0:.1f} s, dtype={dtype}, "
          f"max_num_seqs={args.max_num_seqs}, max_num_batched_tokens="
          f"{args.max_num_batched_tokens}, max_model_len={max_len}, KV blocks="
          f"{runner.num_blocks} x {runner.block_size} tokens, gpu_memory_utilization="
          f"{args.gpu_memory_utilization}, decode CUDA graphs="
          f"{'off' if graphs is None else getattr(graphs, 'rungs', 'on')}, "
          f"prefix caching {'off' if args.no_prefix_caching else 'on'} (prompts share no prefix)",
          flush=True)
    steps = [0]
    real_step = llm.engine.step

    def counted_step(*args, **kwargs):
        steps[0] += 1
        return real_step(*args, **kwargs)

    llm.engine.step = counted_step  # instance attribute: counts engine steps, nothing else
    forwards: list[tuple[int, int, float]] = []  # (decode rows, prefill tokens, seconds)
    real_forward = model.mixed_forward_batch

    prof = cProfile.Profile() if args.profile_outside else None  # host time outside forwards
    profiling = [False]  # the timed run only

    def timed_forward(decode_tokens, decode_seqs, slices):
        if profiling[0]:
            prof.disable()
        t = time.perf_counter()
        out = real_forward(decode_tokens, decode_seqs, slices)  # samples: ends with a sync
        forwards.append((len(decode_seqs), sum(sl.chunk_len for sl in slices),
                         time.perf_counter() - t))
        if profiling[0]:
            prof.enable()
        return out

    model.mixed_forward_batch = timed_forward  # instance attribute: times each forward
    results = []
    for name, (n, in_len, out_len) in work.items():
        warm = prompts(min(n, WARM_REQUESTS), in_len, cfg["vocab_size"], seed=1)
        llm.generate([{"prompt_token_ids": p} for p in warm],
                     SamplingParams(temperature=0.0, max_tokens=WARM_TOKENS, ignore_eos=True))
        sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        runs = []
        for rep in range(args.repeats):
            if rep and args.repeat_gap:
                time.sleep(args.repeat_gap)
            # each run its own prompts (seed 0 first, as transformers'): a repeat of the same
            # prompts would be served from the prefix cache
            ps = [{"prompt_token_ids": p}
                  for p in prompts(n, in_len, cfg["vocab_size"], seed=rep and 100 + rep)]
            runs.append(_timed_run(llm, ps, sp, name, steps, forwards, prof, profiling, args))
            if args.repeats > 1:
                print(f"[epserve {name}] run {rep + 1} of {args.repeats}: "
                      f"{runs[-1][1] / runs[-1][0]:.1f} out tok/s", flush=True)
            if prof is not None:  # where the outside-forward time goes (cProfile inflates it)
                pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile_outside)
                prof = cProfile.Profile()
        wall, total, nsteps, note = sorted(runs)[len(runs) // 2]  # the median run
        results.append(Result(name, "epserve", wall, total, nsteps, note))
    llm.close()
    return results


def _timed_run(llm, ps, sp, name, steps, forwards, prof, profiling, args) -> tuple:
    """One timed generate of the workload: (wall s, output tokens, engine steps, note), its
    forwards' summary printed."""
    out_len = sp.max_tokens
    steps[0] = 0
    forwards.clear()
    sync(args.device)
    t0 = time.perf_counter()
    with _compile_log(name, t0):
        if prof is not None:
            profiling[0] = True
            prof.enable()
        outs = llm.generate(ps, sp)
        if prof is not None:
            prof.disable()
            profiling[0] = False
    sync(args.device)
    wall = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    note = "" if set(got) == {out_len} else f"tokens per request {sorted(set(got))}"
    dec = [f for f in forwards if f[1] == 0]
    mix = [f for f in forwards if f[1] > 0]
    print(f"[epserve {name}] forwards: {len(dec)} pure decode, "
          f"{sum(f[2] for f in dec):.2f} s, mean {1e3 * sum(f[2] for f in dec) / max(len(dec), 1):.1f} ms "
          f"at mean {sum(f[0] for f in dec) / max(len(dec), 1):.0f} rows; {len(mix)} with prefill, "
          f"{sum(f[2] for f in mix):.2f} s for {sum(f[1] for f in mix)} prompt tokens; "
          f"outside forwards {wall - sum(f[2] for f in forwards):.2f} s", flush=True)
    print(f"[epserve {name}] forwards with prefill (decode rows, prompt tokens, ms): "
          + ", ".join(f"({r}, {t}, {1e3 * s:.0f})" for r, t, s in mix), flush=True)
    return wall, sum(got), steps[0], note


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", nargs="+", choices=sorted(WORKLOADS), default=["short", "long"])
    ap.add_argument("--requests", type=int, help="override the workload's request count")
    ap.add_argument("--in-len", type=int, help="override the prompt length")
    ap.add_argument("--out-len", type=int, help="override the output length")
    ap.add_argument("--model-shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, help="cut the shape to this many layers")
    ap.add_argument("--tiny", action="store_true", help="2-layer tiny config (CPU smoke test)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--repeats", type=int, default=1,
                    help="epserve: time each workload this many times (new prompts each "
                    "time), report the median run")
    ap.add_argument("--repeat-gap", type=float, default=0.0, metavar="S",
                    help="seconds idle before each repeat (does the GPU cool between runs?)")
    ap.add_argument("--num-kv-blocks", type=int, help="epserve: KV blocks (default: by memory)")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="epserve: freed blocks go straight back to the free list")
    ap.add_argument("--profile-outside", type=int, default=0, metavar="N",
                    help="cProfile the host work outside the forwards; print its top N")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true", help="epserve: no CUDA graphs")
    ap.add_argument("--hf-attn", default=None,
                    help="transformers attn_implementation (default: paged|flash_attention_2 "
                         "when flash_attn is importable on CUDA, else paged|sdpa)")
    ap.add_argument("--hf-block-size", type=int, default=256, help="transformers KV page size")
    ap.add_argument("--hf-num-blocks", type=int,
                    help="transformers KV blocks (default: sized from free memory)")
    ap.add_argument("--hbm-gbps", type=float, default=4251.0, help="measured d2d copy GB/s")
    args = ap.parse_args(argv)
    if args.hf_attn is None:
        import importlib.util

        flash = args.device.startswith("cuda") and importlib.util.find_spec("flash_attn")
        args.hf_attn = "paged|flash_attention_2" if flash else "paged|sdpa"
    cfg = TINY if args.tiny else shape(args.model_shape, args.layers)
    on_cuda = args.device.startswith("cuda")
    work = {}
    for w in args.workload:
        n, i, o = WORKLOADS[w]
        work[w] = (args.requests or n, args.in_len or i, args.out_len or o)
    results: list[Result] = []
    if not args.skip_transformers:
        try:
            run = run_transformers_generate if _hybrid(cfg) else run_transformers
            results += run(cfg, work, args, torch.bfloat16 if on_cuda else torch.float32)
        except Exception as exc:  # noqa: BLE001 - a failed baseline must not lose epserve's rows
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            print(f"[transformers] generate_batch could not run on {args.device}, skipped: {msg}",
                  flush=True)
            results += [Result(w, "transformers", note="skipped, see above") for w in work]
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            print(f"[transformers freed] GPU memory in use before epserve loads: "
                  f"{(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB", flush=True)
    try:
        results += run_epserve(cfg, work, args, "bfloat16" if on_cuda else "float32")
    except ModuleNotFoundError as exc:
        if _no_ray(exc):
            return 2
        raise

    print(f"\nmodel: {args.model_shape} shape{' (tiny)' if args.tiny else ''}, "
          f"{cfg['num_hidden_layers']} layers, random {'bf16' if on_cuda else 'fp32'}, "
          f"device {args.device}; greedy, EOS ignored; transformers attn {args.hf_attn}")
    print("| workload | engine | wall s | out tok/s | mean step ms | floor / wall "
          "| epserve / transformers |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for w, (n, in_len, out_len) in work.items():
        fl = floor_s(cfg, min(n, args.max_num_seqs), out_len, args.hbm_gbps)
        rows = {r.engine: r for r in results if r.workload == w}
        hf, ep = rows.get("transformers"), rows.get("epserve")
        label = f"{w} ({n} x {in_len}->{out_len})"
        for r in (hf, ep):
            if r is None:
                continue
            step = r.wall_s / r.steps * 1e3 if r.steps and r.wall_s else None
            frac = fl / r.wall_s if r.wall_s else None
            ratio = "-"
            if r is ep and hf is not None and hf.tok_s and ep.tok_s:
                ratio = f"{ep.tok_s / hf.tok_s:.2f}x"
            note = f" ({r.note})" if r.note else ""
            print(f"| {label} | {r.engine}{note} | {fmt(r.wall_s, '.2f')} | "
                  f"{fmt(r.tok_s, '.1f')} | {fmt(step, '.2f')} | {fmt(frac, '.3f')} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
