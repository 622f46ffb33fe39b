"""Our models against Hugging Face transformers (fp32, eager attention) on tiny random checkpoints.

Every logit of every position must match within 1e-4: a whole-batch prefill of ragged
sequences, and a schedule of prefill chunks, mixed prefill/decode steps and decodes over a
paged KV cache with shuffled blocks whose unused slots hold garbage.
"""

from __future__ import annotations

import pytest
import torch

from epserve.models.loader import load_model
from paged_runner import PagedRunner, Schedule
from paged_runner import hf_logits as _hf_logits
from paged_runner import prompts as _prompts
from tiny_ckpt import make_tiny_checkpoint

ATOL = 1e-4

CASES = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_dense_tied": ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2,
                                               mlp_only_layers=[3], tie_word_embeddings=True,
                                               norm_topk_prob=True)),
    "qwen3_moe_sharded": ("qwen3_moe", dict(sharded=True, seed=1)),
    "mixtral": ("mixtral", {}),
    "mixtral_sliding_window": ("mixtral", dict(sliding_window=6, seed=2)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def models(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    arch, kwargs = CASES[request.param]
    path = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(request.param), **kwargs)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    ours, cfg = load_model(path, dtype=torch.float32, device="cpu")
    return hf.eval(), ours, cfg


def test_prefill_batch_matches_transformers(models):
    hf, ours, cfg = models
    prompts = _prompts(cfg.vocab_size, [5, 11, 8], seed=10)
    runner = PagedRunner(ours, cfg)
    out = runner.step([(f"s{i}", p) for i, p in enumerate(prompts)], pad=3)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(out[f"s{i}"], _hf_logits(hf, p), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_matches_transformers(models):
    hf, ours, cfg = models
    a, b, c = _prompts(cfg.vocab_size, [9, 14, 6], seed=11)
    sched = Schedule(PagedRunner(ours, cfg, seed=1), {"a": a, "b": b, "c": c})
    run, decode = sched.run, sched.decode
    run([("a", a[:4]), ("b", b[:7])])
    run([("a", a[4:]), ("b", b[7:])], pad=2)
    run([decode("a"), decode("b"), ("c", c)])  # decodes and a whole prefill in one step
    run([decode("a"), decode("b"), decode("c")])
    run([decode("c"), decode("a"), decode("b")])
    run([decode("c")])
    assert {k: len(v) for k, v in sched.tokens.items()} == {"a": 12, "b": 17, "c": 9}
    sched.check(hf, ATOL)  # and greedy agrees with transformers
