"""Decode CUDA graphs (skipped without a GPU): what a user sees is unchanged by them.

- Greedy and seeded-random outputs with graphs equal ``enforce_eager=True`` outputs, for batch
  sizes on a rung (4), between rungs (3, 5), a single row (its own one-row graph) and above the
  ladder's top (130 rows: the 160-row graph), with requests finishing at different steps so
  the batch walks down the ladder.
- The decode lookahead (on by default with graphs) changes no token, rows stopping early
  behind it and preemption included.
- Padded rows write no KV: after a run, every KV block no sequence ever held is still zero.
"""

from __future__ import annotations

import random

import pytest
import torch

from epserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _prompts(n: int, seed: int = 11) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randrange(3, 40))]}
            for _ in range(n)]


def _params(n: int) -> list[SamplingParams]:
    # different lengths: rows leave the batch at different steps; odd rows sample with a seed
    return [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=i, max_tokens=8 + 5 * (i % 4),
                           ignore_eos=True) for i in range(n)]


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_match_eager(tiny_ckpt, dtype):
    common = dict(model=str(tiny_ckpt), dtype=dtype, device="cuda", num_kv_blocks=1024,
                  max_num_seqs=160)
    graphs = LLM(**common)
    runner = graphs.model.runner
    assert runner.graphs is not None and runner.graphs.rungs[-2:] == [128, 160]
    eager = LLM(**common, enforce_eager=True)
    assert eager.model.runner.graphs is None
    for n in (1, 3, 4, 5, 130):
        prompts, params = _prompts(n, seed=n), _params(n)
        assert _tokens(graphs, prompts, params) == _tokens(eager, prompts, params), n
    assert runner.lookahead is not None and runner.lookahead.hits > 0  # on by default


def test_lookahead_matches_without_it_when_rows_stop_early(qwen3_ckpt):
    """Rows ending on stop tokens behind a queued lookahead forward; a tight KV pool."""
    common = dict(model=str(qwen3_ckpt), dtype="bfloat16", device="cuda", num_kv_blocks=40,
                  block_size=4)
    prompts = _prompts(12, seed=4)
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=48, stop_token_ids=[7, 8, 9])
    on = LLM(**common)
    off = LLM(**common, decode_lookahead=False)
    assert _tokens(on, prompts, params) == _tokens(off, prompts, params)
    la = on.model.lookahead
    assert 0 < la.hits < la.launched


def test_padded_rows_write_no_kv(qwen3_ckpt):
    llm = LLM(model=str(qwen3_ckpt), dtype="bfloat16", device="cuda", num_kv_blocks=512,
              enable_prefix_caching=False)
    book, runner = llm.model.book, llm.model.runner
    held: set[int] = set()
    real_reserve = book.reserve_blocks

    def spy(seq, num_tokens):  # record every block a sequence is ever given
        ok = real_reserve(seq, num_tokens)
        held.update(seq.block_table)
        return ok

    book.reserve_blocks = spy
    llm.generate(_prompts(3), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert held
    never = torch.tensor(sorted(set(range(runner.num_blocks)) - held), device="cuda")
    for k_cache, v_cache in runner.kv_caches:
        assert torch.count_nonzero(k_cache[never]) == 0
        assert torch.count_nonzero(v_cache[never]) == 0
