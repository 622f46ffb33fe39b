"""Rejection sampling keeps the target's distribution (the modified-rejection rule for a
deterministic draft ``x``): over thousands of seeded verify rows of ``[c, x]`` after a fixed
context, the draft is accepted at the rate ``p0(x)``; a rejected row's token follows ``p0``
without ``x``, renormalised; an accepted row's next token follows ``p1`` (the target's given
``c, x``). ``p0`` and ``p1`` come from transformers fp32 (the oracle). Checked for a draft the
target likes (its argmax) and one it does not (a low-probability token).

Statistic: Pearson's chi-square over the most likely tokens (each expected >= 5 times) plus one
"the rest" bucket, against the 0.1% critical value; the acceptance count against a 4.5-sigma
binomial band. A wrong rule (accepting too often, resampling from ``p`` with ``x`` left in,
drawing the bonus token from the wrong position) fails by far more than that at this size.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from epserve.cluster.engine_args import EngineArgs
from epserve.models.traits import PrefillSlice, RowSampling
from epserve.worker.step_model import StepModel
from oracle import hf_model
from tiny_ckpt import SUCC_HI, SUCC_LO, make_trained_checkpoint

CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12,
            9: 27.88, 10: 29.59, 11: 31.26, 12: 32.91}
TEMPERATURE = 1.0
ROWS, BATCHES = 64, 40  # 2,560 draws per draft
CONTEXT = list(range(40, 52))  # a successor chain: the model is sure what comes next
FED = 52


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Trained briefly: its favourite next token has ~75% and dozens of others ~0.5% each."""
    return make_trained_checkpoint("qwen3_moe", tmp_path_factory.mktemp("trained"), steps=40,
                                   dtype=torch.float32)


def _probs(path, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(str(path))(torch.tensor([tokens])).logits[0, -1].float()
    return torch.softmax(logits / TEMPERATURE, -1).double()


def _chi2(counts: Counter, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` (n draws) against ``probs``, over the likeliest ids
    with an expected count >= 5 and one bucket for the rest; (statistic, degrees of freedom)."""
    order = torch.argsort(probs, descending=True).tolist()
    keep = [t for t in order if probs[t] * n >= 5][:12]
    rest_p = 1.0 - float(probs[keep].sum())
    cells = [(counts.get(t, 0), float(probs[t]) * n) for t in keep]
    cells.append((n - sum(c for c, _ in cells), rest_p * n))
    cells = [(o, e) for o, e in cells if e > 0]
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


def _draws(path, draft: int) -> list[tuple[int, int | None]]:
    """(first emitted token, second emitted token or None) of ROWS * BATCHES seeded verify
    rows ``[FED, draft]`` after CONTEXT."""
    model = StepModel.one_rank(EngineArgs(model=str(path), dtype="float32", max_num_seqs=ROWS,
                                          enable_prefix_caching=False).resolved()
                               .runner_config())
    seqs = []
    for r in range(ROWS):
        s = model.alloc_sequence_for(64, CONTEXT)
        s.prompt_len = len(CONTEXT)
        assert model.reserve_blocks(s, len(CONTEXT) + 2)
        seqs.append(s)
    model.prefill_batch_chunk([PrefillSlice(CONTEXT, s, 0, len(CONTEXT), True) for s in seqs])
    out = []
    for b in range(BATCHES):  # the same context each time, other seeds: rewound after each
        for r, s in enumerate(seqs):
            s.sampling = RowSampling(temperature=TEMPERATURE, seed=b * ROWS + r)
            s.output_index = 1
            assert model.reserve_blocks(s, len(CONTEXT) + 2)
        runs = model.decode_verify_batched([FED, draft] * ROWS, [1] * ROWS, seqs)
        for run in runs:
            first = run[0].token_id
            out.append((first, run[1].token_id if first == draft else None))
        for s in seqs:
            model.rewind_sequence(s, len(CONTEXT))
    return out


@pytest.mark.parametrize("which", ["close", "far"])
def test_verify_keeps_the_target_distribution(trained, which):
    p0 = _probs(trained, CONTEXT + [FED])
    ranked = torch.argsort(p0, descending=True).tolist()
    # close: the target's favourite; far: a token it gives about 1% (in the successor range)
    draft = ranked[0] if which == "close" else min(
        (t for t in ranked if SUCC_LO <= t < SUCC_HI), key=lambda t: abs(float(p0[t]) - 0.01))
    draws = _draws(trained, draft)
    n = len(draws)
    px = float(p0[draft])
    acc = sum(1 for f, _ in draws if f == draft)
    assert abs(acc - n * px) <= 4.5 * math.sqrt(n * px * (1 - px)) + 1, (acc, n * px)

    stat, dof = _chi2(Counter(f for f, _ in draws), p0, n)  # what is emitted first: p0
    assert dof >= 3 and stat < CHI2_999[dof], (stat, dof)

    rejected = Counter(f for f, _ in draws if f != draft)  # p0 without the draft
    residual = p0.clone()
    residual[draft] = 0
    residual /= residual.sum()
    stat, dof = _chi2(rejected, residual, n - acc)
    assert dof >= 3 and stat < CHI2_999[dof], (stat, dof)

    if acc >= 200:  # the bonus token after an accepted draft: p1
        p1 = _probs(trained, CONTEXT + [FED, draft])
        stat, dof = _chi2(Counter(s for f, s in draws if f == draft), p1, acc)
        assert dof >= 1 and stat < CHI2_999[dof], (stat, dof)
    assert which == "far" or acc >= 200  # the close draft is accepted often enough to check
