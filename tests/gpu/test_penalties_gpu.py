"""Sampling penalties in the sampler on CUDA: the same tokens and logprobs as the CPU path for the
same logits and penalty table, penalized rows (with and without a logit bias) mixed with plain
ones; still one host sync a step."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from host_syncs import host_syncs

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

R, V = 48, 151936


def _case():
    from epserve.models.traits import RowSampling
    from epserve.worker.penalties import PenaltyBook

    book, rows, fed = PenaltyBook(), [], {}
    for i in range(R):
        pen = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3) \
            if i % 2 else {}
        bias = (((i * 7) % V, 5.0),) if i % 4 == 1 else ()
        rows.append([RowSampling(temperature=0.0, logprobs=2, logit_bias=bias, **pen),
                     RowSampling(temperature=0.9, seed=i, top_k=50, logit_bias=bias, **pen)][i % 2])
        book.start(i, rows[-1])
        fed[i] = [(i * 31 + j * 17) % V for j in range(40)]  # 20 prompt, 20 output tokens
    fed = {s: t for s, t in fed.items() if s in book.history}
    table = book.table(list(range(R)), rows, fed, lambda s: 20)
    return rows, table


def test_penalized_rows_draw_alike_on_cuda_and_cpu():
    from epserve.worker.sampler import launch_sample

    x = torch.randn(R, V, generator=torch.Generator().manual_seed(1)) * 4
    rows, table = _case()
    idx = list(range(R))
    cpu = launch_sample(x, rows, idx, table).result()
    gpu = launch_sample(x.cuda(), rows, idx, table).result()
    assert [t.token_id for t in gpu] == [t.token_id for t in cpu]
    for g, c in zip(gpu, cpu):
        assert g.logprob == pytest.approx(c.logprob, abs=1e-4)


def test_one_host_sync_with_penalties():
    from epserve.worker.sampler import launch_sample

    x = torch.randn(R, V, device="cuda")
    rows, table = _case()
    syncs = host_syncs(lambda: launch_sample(x, rows, list(range(R)), table).result())
    assert len(syncs) <= 1, syncs
