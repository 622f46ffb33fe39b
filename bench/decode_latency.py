"""Batch-1 (and batch-B) decode step time of epserve on one GPU, random bf16 weights.

Shapes: ``--model-shape`` (bench/shapes.py), default Qwen3-30B-A3B. The step time is steady-state decode: the median wall time
of the decode steps of ``--repeats`` generates of S+1 tokens (each step timed from the
engine's previous step return to its own: host work, graph replay, LM head, sampling and the
token copy back; the prefill step left out), with the 90th percentile beside it. With
``--with-transformers`` the same config (random bf16) runs through transformers ``generate`` at
batch 1 first, in the same process, and the table gets its step time and the ratio. Prints a
table last.

    python bench/decode_latency.py [--model-shape qwen3-30b-a3b] [--layers 48] [--batch 1 8] [--steps 32] [--with-transformers]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from epserve import LLM, SamplingParams
from shapes import QWEN3_30B_A3B, SHAPES, active_bytes, hf_config, shape  # noqa: F401

def transformers_step_ms(cfg: dict, steps: int) -> float:
    """transformers ``generate`` at batch 1 on the same config (random bf16 weights)."""
    import gc

    from transformers import AutoModelForCausalLM

    hf_cfg = hf_config(cfg)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(5, 1000, (1, 16), device="cuda")
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **kw)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / steps * 1e3
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return ms


def decode_step_ms(llm: LLM, prompts: list[dict], steps: int) -> list[float]:
    """The wall time of each decode step of one generate of ``steps + 1`` tokens per prompt:
    the intervals between the engine's step returns after the first (the prefill step). Each
    step ends in the sampled tokens' device-to-host copy, so an interval is a whole step."""
    ends: list[float] = []
    step = llm.engine.step

    def timed(*a, **kw):
        out = step(*a, **kw)
        ends.append(time.perf_counter())
        return out

    llm.engine.step = timed
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps + 1,
                                             ignore_eos=True))
    finally:
        del llm.engine.step  # back to the class's method
    return [(b - a) * 1e3 for a, b in zip(ends, ends[1:])]


def graph_replay_ms(llm: LLM, batch: int, iters: int = 50) -> float | None:
    """Milliseconds per replay of the decode graph a ``batch``-row step uses, replayed back to
    back with no host work between (None without graphs). Every row writes its KV into blocks
    taken from the pool for the measurement (a negative slot would make it a padding row,
    which routes to no expert), freed afterwards."""
    from epserve.worker.cuda_graphs import graph_batch

    model = llm.model
    runner = model.runner  # the device side: graphs, block size
    graphs = getattr(runner, "graphs", None)
    b = graph_batch(batch)
    if graphs is None or b not in graphs._graphs:
        return None
    graph = graphs._graphs[b][0]  # (graph, output, logged rows)
    blocks = model.pool.allocate(-(-b // runner.block_size))
    slots = [blocks[i // runner.block_size] * runner.block_size + i % runner.block_size
             for i in range(b)]
    graphs.slots[:b].copy_(torch.tensor(slots, dtype=torch.int64))
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    model.pool.free(blocks)
    return start.elapsed_time(end) / iters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, help="cut the shape to this many layers")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--hbm-gbps", type=float, default=4251.0, help="measured d2d copy GB/s")
    ap.add_argument("--with-transformers", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="generates per batch size")
    ap.add_argument("--decode-lookahead", choices=["on", "off"],
                    help="force the decode lookahead (default: the engine's choice, on with "
                    "decode graphs; with recurrent state for steps of up to 4 rows)")
    args = ap.parse_args(argv)
    cfg = shape(args.model_shape, args.layers)
    hf_ms = transformers_step_ms(cfg, args.steps) if args.with_transformers else None
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    lookahead = None if args.decode_lookahead is None else args.decode_lookahead == "on"
    llm = LLM(model=str(folder), dtype="bfloat16", load_format="dummy", device="cuda",
              max_model_len=2048, decode_lookahead=lookahead)  # KV pool: gpu_memory_utilization
    load_s = time.perf_counter() - t0
    floor_ms = active_bytes(cfg) / (args.hbm_gbps * 1e9) * 1e3
    rows = []
    for b in args.batch:
        prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 5 for j in range(16)]}
                   for i in range(b)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        steps_ms: list[float] = []
        for rep in range(args.repeats):  # new prompts each: no prefix hit
            ps = [{"prompt_token_ids": [t + 1000 * (rep + 1) for t in p["prompt_token_ids"]]}
                  for p in prompts]
            steps_ms += decode_step_ms(llm, ps, args.steps)
        steps_ms.sort()
        med, p90 = steps_ms[len(steps_ms) // 2], steps_ms[int(len(steps_ms) * 0.9)]
        rows.append((b, med, p90, b * 1e3 / med, graph_replay_ms(llm, b)))
    print(f"\nmodel: {args.model_shape} shape, {cfg['num_hidden_layers']} layers, random bf16, "
          f"load {load_s:.1f} s; "
          f"HBM floor at batch 1: {floor_ms:.2f} ms ({active_bytes(cfg) / 1e9:.2f} GB)")
    if hf_ms is not None:
        print(f"transformers generate, batch 1, same run: {hf_ms:.2f} ms per token")
    print("(step ms: median and 90th percentile of the decode steps' wall times; graph ms: the "
          "decode graph's replay alone, back to back: the step's GPU time without the LM head, "
          "sampling and host work)")
    print("| batch | step ms | p90 ms | graph ms | out tok/s | floor / step "
          "| transformers ms (batch 1) | speedup |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b, ms, p90, tps, g_ms in rows:
        hf = f"{hf_ms:.2f}" if hf_ms is not None and b == 1 else "-"
        ratio = f"{hf_ms / ms:.2f}x" if hf_ms is not None and b == 1 else "-"
        g = "-" if g_ms is None else f"{g_ms:.2f}"
        print(f"| {b} | {ms:.2f} | {p90:.2f} | {g} | {tps:.1f} | {floor_ms / ms:.3f} | {hf} "
              f"| {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
