"""The CUDA path (skipped without a GPU): fp32 on the GPU equals transformers; bf16 on the GPU
agrees with the CPU fp32 path on >= 99% of the first 64 greedy tokens over 32 prompts."""

from __future__ import annotations

import random

import pytest
import torch

from epserve import LLM, SamplingParams
from oracle import hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NEW = 64


def _prompts(n: int = 32, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(4, 48))] for _ in range(n)]


def _greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_fp32_on_cuda_matches_transformers(tiny_ckpt):
    prompts = _prompts(8)
    llm = LLM(model=str(tiny_ckpt), dtype="float32", device="cuda", num_kv_blocks=2048)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(32))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(tiny_ckpt, p, 32)[0]


@pytest.mark.xfail(strict=False, reason="issue 6: measured 2026-12-03 on one H200, 44% (qwen3) and "
                   "20% (mixtral) of greedy positions agree (the tiny fp32 checkpoints are cast to "
                   "bf16, and random tiny models have many near-ties); the bar is 99%")
def test_bf16_on_cuda_agrees_with_cpu_fp32(tiny_ckpt):
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    ref = LLM(model=str(tiny_ckpt), dtype="float32", device="cpu").generate(prompts, _greedy())
    got = LLM(model=str(tiny_ckpt), dtype="bfloat16", device="cuda",
              num_kv_blocks=2048).generate(prompts, _greedy())
    same = total = 0
    for a, b in zip(ref, got):
        for x, y in zip(a.outputs[0].token_ids, b.outputs[0].token_ids):
            same += x == y
            total += 1
    print(f"bf16 cuda vs fp32 cpu: {same}/{total} = {same / total:.4f}")
    assert same / total >= 0.99
