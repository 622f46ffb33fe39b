"""How closely bf16 on the GPU follows the fp32 CPU path, and how closely transformers' own bf16
follows it, on bf16-saved tiny checkpoints (both paths read the same weights): random ones
(near ties everywhere) and ones trained on CPU for seconds to continue each token with its
successor (wide margins, as a trained model's picks mostly have).

Two measures over 32 prompts x 64 greedy tokens, per architecture:
- free-running: position-wise agreement of the two greedy continuations (one early flip makes
  every later position differ, so this measures how chaotic the model is as much as the path);
- teacher-forced: at each position of the fp32 continuation, does the bf16 path's argmax (given
  the fp32 prefix) pick the same token (epserve: prompt logprobs; transformers: one forward).
Prints a table last.

    python bench/agreement.py
"""

from __future__ import annotations

import itertools
import random
import sys
import tempfile
from pathlib import Path

import torch

from epserve import LLM, SamplingParams

_TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(_TESTS), str(_TESTS / "gpu")]
from bench_agreement import teacher_forced  # noqa: E402
from tiny_ckpt import make_tiny_checkpoint, make_trained_checkpoint  # noqa: E402

NEW = 64


def prompts(n: int = 32, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(4, 48))] for _ in range(n)]


def _same(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for u, v in zip(a, b) for x, y in zip(u, v))


def _free_running(path: str, ps: list[list[int]], ref: list[list[int]]) -> tuple[int, int]:
    """Greedy continuations of epserve bf16 and transformers bf16 (both CUDA) that match ref."""
    from transformers import AutoModelForCausalLM

    gpu = LLM(model=path, dtype="bfloat16", device="cuda", num_kv_blocks=2048)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    ours = _same(ref, [o.outputs[0].token_ids for o in gpu.generate(
        [{"prompt_token_ids": p} for p in ps], sp)])
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    theirs = []
    for p in ps:
        out = m.generate(torch.tensor([p], device="cuda"), do_sample=False, max_new_tokens=NEW,
                         min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
        theirs.append(out[0, len(p):].tolist())
    return ours, _same(ref, theirs)


def main() -> int:
    rows = []
    for arch, trained in itertools.product(("qwen3_moe", "mixtral"), (False, True)):
        make = make_trained_checkpoint if trained else make_tiny_checkpoint
        path = str(make(arch, tempfile.mkdtemp(), dtype=torch.bfloat16))
        ps = prompts()
        sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
        ref = [o.outputs[0].token_ids for o in LLM(model=path, dtype="float32", device="cpu")
               .generate([{"prompt_token_ids": p} for p in ps], sp)]
        n = sum(len(r) for r in ref)
        free_ours, free_theirs = _free_running(path, ps, ref)
        forced_ours, forced_theirs, _ = teacher_forced(path, ps, ref)
        name = f"{arch} {'trained (successor task)' if trained else 'random'}"
        rows.append((name, n, free_ours, forced_ours, free_theirs, forced_theirs))
    print("\n| checkpoint | positions | epserve free | transformers free | epserve forced "
          "| transformers forced |")
    print("|---|---:|---:|---:|---:|---:|")
    for arch, n, ef, eforced, hf, hforced in rows:
        print(f"| {arch} | {n} | {ef / n:.3f} | {hf / n:.3f} | {eforced / n:.3f} | "
              f"{hforced / n:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
