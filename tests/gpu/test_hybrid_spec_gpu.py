"""Speculative decoding on a gated-DeltaNet hybrid on CUDA (skipped without a GPU): a verify
step's k + 1 positions a row are one-token rows for attention and one held run for the
recurrence (the varlen kernels), replayed from the verify CUDA graphs; the accepted prefix is
folded in afterwards; plain decode steps replay the decode graphs. n-gram and MTP speculation
change no token of the fp32 output (bf16 would let a held-then-folded state round differently
from a decoded one), and the MTP head's drafts are mostly accepted."""

from __future__ import annotations

import pytest
import torch

from epserve import LLM, SamplingParams
from spec_ckpt import counting_prompts, make_successor_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)


def _common(path) -> dict:
    return dict(model=str(path), dtype="float32", device="cuda", max_model_len=256,
                num_kv_blocks=256, block_size=16)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_ngram_speculation_on_a_hybrid_changes_no_token(tmp_path, arch):
    ckpt = make_successor_checkpoint(arch, tmp_path / arch)
    reqs = [{"prompt_token_ids": p} for p in counting_prompts()]
    plain = LLM(**_common(ckpt))
    spec = LLM(**_common(ckpt), speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1})
    runner = spec.model.runner
    assert runner.graphs is not None and runner.verify_graphs is not None
    for sp in (GREEDY, SEEDED):
        want = [o.outputs[0].token_ids for o in plain.generate(reqs, sp)]
        assert [o.outputs[0].token_ids for o in spec.generate(reqs, sp)] == want
    g = runner.verify_graphs  # the verify steps and their folds ran from their graphs
    assert g.replays > 0 and g.fold_replays == g.replays
    st = spec.engine.stats.spec
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens, st


def test_mtp_speculation_on_cuda_changes_no_token(trained_mtp_ckpt):
    reqs = [{"prompt_token_ids": p} for p in counting_prompts()]
    want = [o.outputs[0].token_ids for o in LLM(**_common(trained_mtp_ckpt)).generate(reqs,
                                                                                       GREEDY)]
    spec = LLM(**_common(trained_mtp_ckpt),
               speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert [o.outputs[0].token_ids for o in spec.generate(reqs, GREEDY)] == want
    runner = spec.model.runner
    assert runner.verify_graphs.replays > 0 and runner.mtp.graphs[0].replays > 0
    assert runner.verify_graphs.fold_replays == runner.verify_graphs.replays
    st = spec.engine.stats.spec
    assert st.num_accepted_tokens >= 0.5 * st.num_draft_tokens > 0, st
