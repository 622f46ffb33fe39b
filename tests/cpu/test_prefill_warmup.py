"""The start-up prefill warm-up (run on CUDA to compile prefill-size kernels before the first
request): a full step's worth of padded prompt rows, which must leave the KV cache untouched and
the engine's answers unchanged."""

from __future__ import annotations

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.worker.warmup import warm_up_prefill


def test_warm_up_writes_no_kv_and_changes_no_output(qwen3_ckpt):
    llm = LLM(model=str(qwen3_ckpt), dtype="float32", max_model_len=40,
              max_num_batched_tokens=96)
    r = llm.model.runner
    assert r.cfg.warmup_tokens == 96  # the engine asks for one full step
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = llm.generate([{"prompt_token_ids": [5, 9, 11, 3]}], greedy)[0].outputs[0].token_ids
    caches = [(k.clone(), v.clone()) for k, v in r.kv_caches]
    def warm(n):  # what the runner runs at start on CUDA
        return warm_up_prefill(r._forward, r.model.compute_logits, n, r.max_model_len,
                               r.block_size, r.device)

    hidden = warm(96)  # 2 prompts of 39 tokens and one of 18 (max_model_len 40)
    assert hidden.shape == (96, r.model_config.hidden_size)
    assert torch.isfinite(hidden).all()
    for (k0, v0), (k1, v1) in zip(caches, r.kv_caches):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    after = llm.generate([{"prompt_token_ids": [5, 9, 11, 3]}], greedy)[0].outputs[0].token_ids
    assert after == before
    with pytest.raises(ValueError, match="num_tokens"):
        warm(0)
