"""Where a batch-1 decode step's time goes: torch profiler over a few decode steps of the
Qwen3-30B-A3B shape (random bf16), top ops by self CUDA time and by self CPU time.

    python bench/profile_decode.py [--layers 8] [--steps 4] [--batch 1] [--enforce-eager]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from epserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from decode_latency import QWEN3_30B_A3B  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--enforce-eager", action="store_true", help="profile without CUDA graphs")
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(dict(QWEN3_30B_A3B,
                                                        num_hidden_layers=args.layers)))
    llm = LLM(model=str(folder), dtype="bfloat16", load_format="dummy", device="cuda",
              max_model_len=2048, num_kv_blocks=4096, enforce_eager=args.enforce_eager)
    prompt = [{"prompt_token_ids": list(range(5 + i, 21 + i))} for i in range(args.batch)]
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=args.steps + 1,
                                            ignore_eos=True))
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    print(ka.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
    cuda_us = sum(e.self_device_time_total for e in ka)
    print(f"total self CUDA time {cuda_us / 1e3:.2f} ms over {args.steps + 1} steps "
          f"(batch {args.batch}, {args.layers} layers, graphs {'off' if args.enforce_eager else 'on'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
