"""``logit_bias`` in the sampler on CUDA (Triton Gumbel kernel): the same tokens and logprobs as
the CPU reference path for the same logits, greedy, sampled and filtered rows alike, biased rows
mixed with unbiased ones; a step with biases still makes one host sync (the read-back)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from host_syncs import host_syncs

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

R, V = 64, 151936


def _rows():
    from epserve.models.traits import RowSampling

    rows = []
    for i in range(R):
        bias = ((i * 97) % V, 100.0), ((i * 131 + 5) % V, -100.0), (151000 + i, 7.5)
        bias = tuple(sorted(bias)) if i % 3 else ()
        rows.append([
            RowSampling(temperature=0.0, logit_bias=bias, logprobs=3),
            RowSampling(temperature=1.0, seed=i, logit_bias=bias),
            RowSampling(temperature=0.8, seed=i, top_k=20, top_p=0.9, logit_bias=bias),
            RowSampling(temperature=0.7, seed=i, min_p=0.1, logit_bias=bias, logprobs=0),
        ][i % 4])
    return rows


def test_biased_rows_draw_alike_on_cuda_and_cpu():
    from epserve.worker.sampler import sample_rows

    x = torch.randn(R, V, generator=torch.Generator().manual_seed(0)) * 4
    rows, idx = _rows(), list(range(R))
    cpu = sample_rows(x, rows, idx)
    gpu = sample_rows(x.cuda(), rows, idx)
    assert [t.token_id for t in gpu] == [t.token_id for t in cpu]
    for g, c in zip(gpu, cpu):
        assert g.logprob == pytest.approx(c.logprob, abs=1e-4)
        assert [t for t, _ in g.top] == [t for t, _ in c.top]
    for i, (r, t) in enumerate(zip(rows, cpu)):
        if r.logit_bias and r.temperature == 0.0:
            assert t.token_id == (i * 97) % V  # +100 wins
        assert all(t.token_id != tok for tok, b in r.logit_bias if b < 0)


def test_one_host_sync_with_biases():
    from epserve.worker.sampler import sample_rows

    x = torch.randn(R, V, device="cuda")
    rows, idx = _rows(), list(range(R))
    syncs = host_syncs(lambda: sample_rows(x, rows, idx))
    assert len(syncs) <= 1, syncs
