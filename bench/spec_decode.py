"""Speculative decoding on one GPU (Qwen3-30B-A3B shape, random bf16): what a verify step costs,
what n-gram speculation gives end to end, and what it costs when it proposes nothing.

1. Verify cost: B sequences, each step one verify row of k drafted tokens per sequence (k = 0
   is a plain decode step), timed step by step through ``decode_verify_batched`` (host work,
   the forward, sampling and the read-back). A verify of k drafts runs B * (k + 1) one-token
   rows (a decode batch whose rows share block tables: the decode CUDA graphs). Beside each:
   the experts those rows are expected to hit (E(1 - (1 - topk/E)^rows), random routing) and
   the HBM floor of reading their weights once.
2. End to end: ``LLM.generate`` of B prompts that repeat a phrase, greedy, with and without
   ``{"method": "ngram", "num_speculative_tokens": k}``; output tok/s, the acceptance rate
   (accepted / drafted) and tokens per verify row.
3. Overhead: batch 1 with the proposer on but never matching (``prompt_lookup_min`` above
   any repeat): the decode step time against no speculation.

    python bench/spec_decode.py [--layers 48] [--k 1 2 3 4] [--batch 1 8 32] [--out-len 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from epserve import LLM, SamplingParams
from epserve.head.engine import Engine
from epserve.head.speculative import SpeculativeConfig
from epserve.models.traits import PrefillSlice, RowSampling

sys.path.insert(0, str(Path(__file__).parent))
from decode_latency import QWEN3_30B_A3B, active_bytes, decode_step_ms  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def experts_hit(cfg: dict, rows: int) -> float:
    e, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    return e * (1 - (1 - k / e) ** rows)


def floor_ms(cfg: dict, rows: int, gbps: float) -> float:
    """Reading once the weights ``rows`` tokens touch (KV reads left out: short contexts)."""
    return active_bytes(dict(cfg, num_experts_per_tok=experts_hit(cfg, rows))) / (gbps * 1e9) * 1e3


def verify_ms(llm: LLM, batch: int, k: int, steps: int) -> float:
    """Mean wall ms of a step of ``batch`` verify rows of ``k`` drafts each (k = 0: decode),
    over ``steps`` steps in a row."""
    m = llm.model
    rng = random.Random(batch * 31 + k)
    seqs = []
    for b in range(batch):
        prompt = [rng.randrange(5, 30000) for _ in range(32)]
        s = m.alloc_sequence_for(2048, prompt)
        s.sampling, s.prompt_len = RowSampling(temperature=0.0), len(prompt)
        assert m.reserve_blocks(s, len(prompt))
        seqs.append((s, prompt))
    firsts = m.prefill_batch_chunk([PrefillSlice(p, s, 0, len(p), True) for s, p in seqs])
    last = [t.token_id for t in firsts]
    t0 = 0.0
    for step in range(steps + 3):
        if step == 3:  # after warm-up steps; steps are timed together (with the decode
            _sync()  # lookahead a decode step's forward overlaps the previous step)
            t0 = time.perf_counter()
        tokens, ks = [], []
        for (s, _), t in zip(seqs, last):
            s.output_index += 1
            assert m.reserve_blocks(s, s.seq_len + 1 + k)
            tokens += [t] + [rng.randrange(5, 30000) for _ in range(k)]
            ks.append(k)
        if k:
            runs = m.decode_verify_batched(tokens, ks, [s for s, _ in seqs])
            last = [r[-1].token_id for r in runs]
        else:
            last = [t.token_id for t in m.decode_batch(tokens, [s for s, _ in seqs])]
    _sync()
    ms = (time.perf_counter() - t0) / steps * 1e3
    for s, _ in seqs:
        m.free_sequence(s)
    return ms


def with_spec(llm: LLM, spec: dict | None) -> None:
    """Swap the LLM's engine for one over the same model with ``spec`` (no reload)."""
    old = llm.backend.engine
    cfg = dataclasses.replace(old.cfg, speculative=SpeculativeConfig.from_dict(spec))
    llm.backend.engine = Engine(old.model, old.tokenizer, cfg)


def looping_prompts(batch: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(batch):
        phrase = [rng.randrange(5, 30000) for _ in range(rng.randrange(6, 16))]
        out.append({"prompt_token_ids": (phrase * 8)[:96]})
    return out


def end_to_end(llm: LLM, batch: int, out_len: int, spec: dict | None) -> tuple[float, float, float]:
    """(out tok/s, acceptance rate, tokens per verify row) of one greedy generate."""
    with_spec(llm, spec)
    prompts = looping_prompts(batch, 7)
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    st = llm.engine.stats.spec
    rate = st.num_accepted_tokens / st.num_draft_tokens if st.num_draft_tokens else 0.0
    per = (st.num_accepted_tokens + st.num_drafts) / st.num_drafts if st.num_drafts else 0.0
    return n / wall, rate, per


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--e2e-batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--hbm-gbps", type=float, default=4251.0, help="measured d2d copy GB/s")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default=None, help="a config.json to use instead (smoke runs)")
    args = ap.parse_args(argv)
    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    if args.shape:
        cfg = json.loads(Path(args.shape).read_text())
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(folder), dtype="bfloat16", load_format="dummy", device=args.device,
              max_model_len=2048)

    cost = []
    for b in args.batch:
        base = verify_ms(llm, b, 0, args.steps)
        cost.append((b, 0, base, base))
        for k in args.k:
            cost.append((b, k, verify_ms(llm, b, k, args.steps), base))
    e2e = []
    k_e2e = max(args.k)
    for b in args.e2e_batch:
        plain = end_to_end(llm, b, args.out_len, None)
        spec = end_to_end(llm, b, args.out_len, {"method": "ngram", "prompt_lookup_max": 4,
                                                  "prompt_lookup_min": 2,
                                                  "num_speculative_tokens": k_e2e})
        e2e.append((b, plain[0], spec))
    with_spec(llm, None)
    p1 = [{"prompt_token_ids": [(7 * j) % 1000 + 5 for j in range(16)]}]
    off = sorted(decode_step_ms(llm, p1, 64))
    with_spec(llm, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1000,
                    "prompt_lookup_max": 1000})
    on = sorted(decode_step_ms(llm, p1, 64))
    off_ms, on_ms = off[len(off) // 2], on[len(on) // 2]

    print(f"\nmodel: Qwen3-30B-A3B shape, {args.layers} layers, random bf16, one GPU")
    print("\n1. verify step (k drafts per row; k = 0 is a decode step), mean of "
          f"{args.steps} steps; rows = batch * (k + 1)")
    print("| batch | k | rows | step ms | x decode | experts hit / layer | HBM floor ms | "
          "floor / step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b, k, ms, base in cost:
        rows = b * (k + 1)
        fl = floor_ms(cfg, rows, args.hbm_gbps)
        print(f"| {b} | {k} | {rows} | {ms:.2f} | {ms / base:.2f} | "
              f"{experts_hit(cfg, rows):.1f} | {fl:.2f} | {fl / ms:.2f} |")
    print(f"\n2. greedy generate, prompts repeating a phrase, {args.out_len} tokens each, "
          f"ngram k = {k_e2e} (lookup 2..4)")
    print("| batch | plain tok/s | ngram tok/s | speedup | acceptance | tokens / verify row |")
    print("|---:|---:|---:|---:|---:|---:|")
    for b, plain, (tps, rate, per) in e2e:
        print(f"| {b} | {plain:.1f} | {tps:.1f} | {tps / plain:.2f}x | {rate:.2f} | {per:.2f} |")
    print("\n3. batch-1 decode step, proposer on but never matching")
    print("| no speculation ms | ngram, no match ms | overhead |")
    print("|---:|---:|---:|")
    print(f"| {off_ms:.3f} | {on_ms:.3f} | {100 * (on_ms / off_ms - 1):+.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
