"""The trained tiny checkpoint the GPU agreement test stands on is what it claims: its fp32
greedy continuation of 32 random prompts follows the successor chain at every position, and
the bf16 CPU path (torch references) gives the same tokens."""

from __future__ import annotations

import random

from epserve import LLM, SamplingParams
from tiny_ckpt import SUCC_HI, SUCC_LO, make_trained_checkpoint


def test_trained_checkpoint_continues_with_successors(tmp_path):
    path = make_trained_checkpoint("qwen3_moe", tmp_path)
    rng = random.Random(3)
    prompts = [[rng.randrange(SUCC_LO, SUCC_HI) for _ in range(rng.randrange(4, 48))]
               for _ in range(32)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model=str(path), dtype=dtype, device="cpu")
        runs[dtype] = [o.outputs[0].token_ids
                       for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    span = SUCC_HI - SUCC_LO
    for p, out in zip(prompts, runs["float32"]):
        want = [SUCC_LO + (p[-1] - SUCC_LO + i) % span for i in range(1, 17)]
        assert out == want
    assert runs["bfloat16"] == runs["float32"]
