"""Where a step's time goes: torch profiler over one prefill step and a few decode steps of
a model shape (bench/shapes.py; random bf16), top ops by self CUDA time and by self CPU time.

    python bench/profile_decode.py [--layers 8] [--steps 4] [--batch 1] [--enforce-eager]
    python bench/profile_decode.py --layers 48 --batch 32 --prompt-len 256 --steps 0  # prefill
    python bench/profile_decode.py --layers 48 --steps 8 --decode-only  # decode steps alone
    python bench/profile_decode.py --layers 48 --steps 64 --host  # Python time per step
    python bench/profile_decode.py --model-shape qwen3.5-35b-a3b --layers 40 --mtp 2 \
        --steps 16 --host  # a speculative step's host time (MTP head, 2 drafts)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from epserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from shapes import SHAPES, shape  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=16,
                    help="tokens per prompt; batch x prompt-len is one prefill step")
    ap.add_argument("--enforce-eager", action="store_true", help="profile without CUDA graphs")
    ap.add_argument("--decode-only", action="store_true",
                    help="per-kernel table of the decode steps alone (minus a prefill-only run)")
    ap.add_argument("--host", action="store_true",
                    help="cProfile of one generate instead: where the host's time per step goes")
    ap.add_argument("--mtp", type=int, default=0, metavar="K",
                    help="speculative decoding with the shape's MTP head, K drafts a step "
                         "(random weights: drafts rejected, every step a verify of K + 1)")
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp())
    cfg = shape(args.model_shape, args.layers)
    if args.mtp:  # one MTP layer, as the hybrids' checkpoints ship it (random under dummy)
        cfg = dict(cfg, mtp_num_hidden_layers=1)
    (folder / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(folder), dtype="bfloat16", load_format="dummy", device="cuda",
              max_model_len=max(2048, args.prompt_len + args.steps + 8), num_kv_blocks=4096,
              max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
              enforce_eager=args.enforce_eager,
              speculative_config={"method": "mtp", "num_speculative_tokens": args.mtp}
              if args.mtp else None)

    def prompts(shift: int) -> list[dict]:  # warm-up and profiled prompts differ: no prefix hit
        return [{"prompt_token_ids": [(7 * i + j + shift) % 1000 + 5
                                      for j in range(args.prompt_len)]} for i in range(args.batch)]

    llm.generate(prompts(500), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    torch.cuda.synchronize()
    t0 = time.perf_counter()  # the same work unprofiled (other prompts: no prefix hit)
    llm.generate(prompts(250), SamplingParams(temperature=0.0, max_tokens=args.steps + 1,
                                              ignore_eos=True))
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3

    def kernels(max_tokens: int, shift: int = 0) -> dict[str, tuple[float, int]]:
        """Self device us and calls per op name over one profiled generate."""
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts(shift), SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True))
            torch.cuda.synchronize()
        if not args.decode_only:
            ka = prof.key_averages()
            print(ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
            print(ka.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
        return {e.key: (e.self_device_time_total, e.count) for e in prof.key_averages()
                if e.self_device_time_total > 0}

    if args.host:
        return host_profile(llm, prompts(900), args.steps, wall_ms)
    full = kernels(args.steps + 1)
    cuda_us = sum(us for us, _ in full.values())
    print(f"unprofiled wall time of the same generate: {wall_ms:.2f} ms")
    print(f"total self CUDA time {cuda_us / 1e3:.2f} ms over {args.steps + 1} steps "
          f"(batch {args.batch}, prompt {args.prompt_len}, {args.layers} layers, graphs {'off' if args.enforce_eager else 'on'})")
    if args.decode_only and args.steps > 0:  # the same generate minus a prefill-only one
        base = kernels(1, shift=750)
        rows = sorted(((us - base.get(k, (0, 0))[0], n - base.get(k, (0, 0))[1], k)
                       for k, (us, n) in full.items()), reverse=True)
        total = sum(r[0] for r in rows)
        print(f"\nper decode step ({args.steps} steps; {total / args.steps / 1e3:.3f} ms of GPU "
              f"time each; per layer: / {args.layers})")
        print("| kernel | us per step | calls per step | us per call |")
        print("|---|---:|---:|---:|")
        for us, n, k in rows[:24]:
            if us <= 0:
                continue
            print(f"| {k[:70]} | {us / args.steps:.1f} | {n / args.steps:.1f} | "
                  f"{us / max(n, 1):.2f} |")
    return 0


def host_profile(llm: LLM, prompts: list[dict], steps: int, wall_ms: float) -> int:
    """cProfile one generate of ``steps + 1`` tokens; top functions by own time per step. The
    wait for the GPU shows up in the one host sync (``tolist``); the rest is host work."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
    prof.disable()
    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values())  # tottime over all functions
    print(f"unprofiled wall time of a generate of {steps + 1} tokens: {wall_ms:.2f} ms")
    print(f"profiled: {total * 1e3 / steps:.3f} ms of host time per step (own time of every "
          "function, the GPU wait included)")
    print("| function | us per step | calls per step |")
    print("|---|---:|---:|")
    top = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:30]
    for (file, line, name), (_, calls, tt, _, _) in top:
        print(f"| {Path(file).name}:{line}({name}) | {tt * 1e6 / steps:.1f} | {calls / steps:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
