"""The MTP proposer's cost per proposed token at batch 1 on one GPU, random bf16 weights.

Shape ``--model-shape`` (bench/shapes.py, default the Qwen3.5-35B-A3B shape with one MTP layer).
With ``speculative_config={"method": "mtp", "num_speculative_tokens": k}`` every step ends with
the rank's MTP passes (``worker/mtp_drafter.py``: pass 0 over the step's computed positions,
then k - 1 chained passes); this times those passes alone (CUDA-synchronised around
``Runner.propose_drafts``) over the decode steps of one generate, and the whole step beside the
plain decode step of the same model without speculation. Random weights accept almost no
draft, so each step is a verify of k + 1 positions: the step time says what a verify costs,
the proposer time what drafting costs. Prints a table last.

    python bench/mtp_cost.py [--model-shape qwen3.5-35b-a3b] [--layers 40] [--k 1 2 3] [--steps 32]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from decode_latency import decode_step_ms
from epserve import LLM
from shapes import SHAPES, shape


def _llm(folder: Path, k: int) -> LLM:
    spec = None if k == 0 else {"method": "mtp", "num_speculative_tokens": k}
    return LLM(model=str(folder), dtype="bfloat16", load_format="dummy", device="cuda",
               max_model_len=2048, num_kv_blocks=512, speculative_config=spec)


def _timed_drafts(llm: LLM) -> list[float]:
    """Wrap the runner's ``propose_drafts`` so each call's GPU-synchronised ms is recorded."""
    runner, took = llm.model.runner, []
    inner = runner.propose_drafts

    def timed(*a, **kw):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = inner(*a, **kw)
        torch.cuda.synchronize()
        took.append((time.perf_counter() - t) * 1e3)
        return out

    runner.propose_drafts = timed
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-shape", choices=sorted(SHAPES), default="qwen3.5-35b-a3b")
    ap.add_argument("--layers", type=int, help="cut the shape to this many layers")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args(argv)
    cfg = dict(shape(args.model_shape, args.layers), mtp_num_hidden_layers=1)
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(cfg))
    prompt = [{"prompt_token_ids": [(7 * j) % 1000 + 5 for j in range(16)]}]
    rows = []
    for k in [0, *args.k]:
        llm = _llm(folder, k)
        decode_step_ms(llm, prompt, 4)  # warm-up
        took = _timed_drafts(llm) if k else []
        steps = sorted(decode_step_ms(llm, [{"prompt_token_ids": [t + 1000 for t in
                                                                   prompt[0]["prompt_token_ids"]]}],
                                      args.steps))
        drafts = sorted(took[1:])  # the prefill step's call left out
        rows.append((k, steps[len(steps) // 2],
                     drafts[len(drafts) // 2] if drafts else None))
        del llm, took
        gc.collect()  # the engine's cycles hold its weights until collected
        torch.cuda.empty_cache()
    print(f"\nmodel: {args.model_shape} shape, {cfg['num_hidden_layers']} layers + 1 MTP layer, "
          f"random bf16 (drafts rejected: every speculative step verifies k + 1 positions)")
    print("| k | step ms (median) | MTP passes ms (median) | ms per proposed token |")
    print("|---:|---:|---:|---:|")
    for k, step_ms, mtp_ms in rows:
        per = "-" if mtp_ms is None else f"{mtp_ms / k:.3f}"
        mtp = "-" if mtp_ms is None else f"{mtp_ms:.3f}"
        print(f"| {k} | {step_ms:.2f} | {mtp} | {per} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
