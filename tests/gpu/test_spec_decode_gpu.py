"""Speculative decoding on CUDA (skipped without a GPU): verify steps run as decode batches
through the CUDA graphs and change no token. On the trained tiny checkpoint (it continues every
token with its successor, cycling through [SUCC_LO, SUCC_HI)), a prompt holding the whole cycle
lets n-gram lookup predict the continuation, so most drafts are accepted."""

from __future__ import annotations

import random

import pytest
import torch

from epserve import LLM, SamplingParams
from tiny_ckpt import SUCC_HI, SUCC_LO, make_trained_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return make_trained_checkpoint("qwen3_moe", tmp_path_factory.mktemp("trained"))


def test_ngram_speculation_on_cuda_changes_no_token(trained):
    rng = random.Random(2)
    cycle = list(range(SUCC_LO, SUCC_HI))
    prompts = [cycle[i:] + cycle[:i + 5] for i in (0, 40, 120)]  # the whole cycle, then more
    prompts += [[rng.randrange(SUCC_LO, SUCC_HI) for _ in range(rng.randrange(4, 30))]
                for _ in range(5)]
    reqs = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=i, max_tokens=40,
                             ignore_eos=True) for i in range(len(prompts))]
    common = dict(model=str(trained), dtype="bfloat16", device="cuda", max_model_len=1024,
                  num_kv_blocks=1024)
    plain = LLM(**common)
    want = [o.outputs[0].token_ids for o in plain.generate(reqs, params)]
    spec = LLM(**common, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                             "prompt_lookup_max": 3, "prompt_lookup_min": 2})
    graphs = spec.model.runner.graphs
    assert graphs is not None
    verify_rows, replay = [], graphs.run

    def replayed(inp, *a, **kw):  # which replays carried verify rows, and how many rows
        if inp.rows.verify:
            verify_rows.append(inp.rows.num_decode)
        return replay(inp, *a, **kw)

    graphs.run = replayed
    got = [o.outputs[0].token_ids for o in spec.generate(reqs, params)]
    assert got == want
    assert verify_rows and max(verify_rows) > len(prompts)  # k + 1 rows per verify row
    st = spec.engine.stats.spec
    assert st.num_drafts > 0 and st.num_accepted_tokens / st.num_draft_tokens > 0.5
