"""The CUDA path (skipped without a GPU): fp32 on the GPU equals transformers; bf16 on the GPU
agrees with the CPU fp32 path on >= 99% of the first 64 greedy tokens over 32 prompts of a
trained tiny checkpoint (on random ones no bf16 path can: see the xfail below)."""

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


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def bf16_ckpt(request, tmp_path_factory):
    """The tiny checkpoint saved in bf16: the fp32 CPU run and the bf16 GPU run read the same
    weights, so what differs is only the arithmetic."""
    from tiny_ckpt import make_tiny_checkpoint

    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param),
                                dtype=torch.bfloat16)


def _fp32_cpu_greedy(path, prompts) -> list[list[int]]:
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    return [o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())]


def test_bf16_teacher_forced_agrees_with_cpu_fp32_like_transformers(bf16_ckpt):
    """At each position of the fp32 greedy continuation, the bf16 GPU argmax (given the fp32
    prefix) is the same token as often as transformers' bf16 argmax is (within 1%); measured
    2026-12-03 on one H200 (bench/agreement.py): qwen3 96.4% vs 96.5%, mixtral 93.2% vs 92.7%."""
    from bench_agreement import teacher_forced  # tests/gpu helper below

    prompts = _prompts()
    ref = _fp32_cpu_greedy(bf16_ckpt, prompts)
    ours, theirs, n = teacher_forced(str(bf16_ckpt), prompts, ref)
    print(f"teacher-forced: epserve bf16 {ours}/{n}, transformers bf16 {theirs}/{n}")
    assert ours / n >= theirs / n - 0.01


@pytest.mark.xfail(strict=False, reason="issue 6 bar (99% free-running) not met on random tiny "
                   "checkpoints: measured 2026-12-03 on one H200, epserve 45% (qwen3) / 21% "
                   "(mixtral), transformers' own bf16 36% / 25% on the same bf16-saved weights; "
                   "one early near-tie flip changes every later token of a random model")
def test_bf16_on_cuda_agrees_with_cpu_fp32(bf16_ckpt):
    same, total = _free_running_agreement(bf16_ckpt)
    print(f"bf16 cuda vs fp32 cpu: {same}/{total} = {same / total:.4f}")
    assert same / total >= 0.99


def _free_running_agreement(path) -> tuple[int, int]:
    """(positions where the bf16 GPU greedy continuation equals the fp32 CPU one, positions)
    over 32 prompts x 64 tokens."""
    prompts = _prompts()
    ref = _fp32_cpu_greedy(path, prompts)
    got = LLM(model=str(path), dtype="bfloat16", device="cuda",
              num_kv_blocks=2048).generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    same = sum(x == y for a, o in zip(ref, got) for x, y in zip(a, o.outputs[0].token_ids))
    return same, sum(len(a) for a in ref)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def trained_ckpt(request, tmp_path_factory):
    """A tiny checkpoint trained on CPU (seconds) to continue every token with its successor,
    saved in bf16: its greedy picks have the wide margins a trained model's mostly have."""
    from tiny_ckpt import make_trained_checkpoint

    return make_trained_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def test_bf16_on_cuda_agrees_with_cpu_fp32_on_a_trained_checkpoint(trained_ckpt):
    """The issue's bar: >= 99% of the first 64 greedy tokens over 32 prompts."""
    same, total = _free_running_agreement(trained_ckpt)
    print(f"trained checkpoint, bf16 cuda vs fp32 cpu: {same}/{total} = {same / total:.4f}")
    assert same / total >= 0.99
