"""Batch-1 (and batch-B) decode step time of epserve on one GPU, random bf16 weights.

Shapes default to Qwen3-30B-A3B. The step time is steady-state decode: the wall time of a
generate with 2S+1 new tokens minus one with S+1, divided by S (prefill and per-call costs
cancel); each length runs ``--repeats`` times and the fastest counts. With
``--with-transformers`` the same config (random bf16) runs through transformers ``generate`` at
batch 1 first, in the same process, and the table gets its step time and the ratio. Prints a
table last.

    python bench/decode_latency.py [--layers 48] [--batch 1 8] [--steps 32] [--with-transformers]
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

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def active_bytes(cfg: dict) -> float:
    """Bytes one decode step must read at batch 1 (bf16): attention, 8 experts, router, lm_head."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    d, hq, hkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attn = h * d * (hq + 2 * hkv) + hq * d * h
    experts = cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"]
    router = h * cfg["num_experts"]
    return 2.0 * (layers * (attn + experts + router) + cfg["vocab_size"] * h)


def transformers_step_ms(cfg: dict, steps: int) -> float:
    """transformers ``generate`` at batch 1 on the same config (random bf16 weights)."""
    import gc

    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    hf_cfg = Qwen3MoeConfig(**{k: v for k, v in cfg.items()
                               if k not in ("architectures", "model_type", "torch_dtype")})
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


def graph_replay_ms(llm: LLM, batch: int, iters: int = 50) -> float | None:
    """Milliseconds per replay of the decode graph a ``batch``-row step uses, replayed back to
    back with no host work between (None without graphs). Slots are set to -1 first: the
    replays write no KV (the last step's slots point into blocks freed since)."""
    from epserve.worker.cuda_graphs import graph_batch

    graphs = getattr(llm.runner, "graphs", None)
    if graphs is None or graph_batch(batch) not in graphs._graphs:
        return None
    graph, _ = graphs._graphs[graph_batch(batch)]
    graphs.slots.fill_(-1)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--hbm-gbps", type=float, default=4251.0, help="measured d2d copy GB/s")
    ap.add_argument("--with-transformers", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="runs per length; the fastest counts")
    args = ap.parse_args(argv)
    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    hf_ms = transformers_step_ms(cfg, args.steps) if args.with_transformers else None
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    llm = LLM(model=str(folder), dtype="bfloat16", load_format="dummy", device="cuda",
              max_model_len=2048)  # KV pool sized by gpu_memory_utilization
    load_s = time.perf_counter() - t0
    floor_ms = active_bytes(cfg) / (args.hbm_gbps * 1e9) * 1e3
    rows = []
    for b in args.batch:
        prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 5 for j in range(16)]}
                   for i in range(b)]
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate(prompts, warm)
        walls = []
        for n_out in (args.steps + 1, 2 * args.steps + 1):  # new prompts each: no prefix hit
            ps = [{"prompt_token_ids": [t + n_out for t in p["prompt_token_ids"]]}
                  for p in prompts]
            sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
            best = float("inf")
            for rep in range(args.repeats):  # the fastest of a few: host hiccups excluded
                rp = [{"prompt_token_ids": [t + 2000 * rep for t in p["prompt_token_ids"]]}
                      for p in ps]
                torch.cuda.synchronize()
                t = time.perf_counter()
                llm.generate(rp, sp)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t)
            walls.append(best)
        # the difference of two runs is args.steps decode steps: the prefill and the
        # per-generate costs cancel
        step_ms = (walls[1] - walls[0]) / args.steps * 1e3
        rows.append((b, step_ms, b * 1e3 / step_ms, graph_replay_ms(llm, b)))
    print(f"\nmodel: Qwen3-30B-A3B shape, {args.layers} layers, random bf16, load {load_s:.1f} s; "
          f"HBM floor at batch 1: {floor_ms:.2f} ms ({active_bytes(cfg) / 1e9:.2f} GB)")
    if hf_ms is not None:
        print(f"transformers generate, batch 1, same run: {hf_ms:.2f} ms per token")
    print("(graph ms: the decode graph's replay alone, back to back: the step's GPU time "
          "without the LM head, sampling and host work)")
    print("| batch | step ms | graph ms | out tok/s | floor / step | transformers ms (batch 1) "
          "| speedup |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b, ms, tps, g_ms in rows:
        hf = f"{hf_ms:.2f}" if hf_ms is not None and b == 1 else "-"
        ratio = f"{hf_ms / ms:.2f}x" if hf_ms is not None and b == 1 else "-"
        g = "-" if g_ms is None else f"{g_ms:.2f}"
        print(f"| {b} | {ms:.2f} | {g} | {tps:.1f} | {floor_ms / ms:.3f} | {hf} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
