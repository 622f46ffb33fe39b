"""sample_rows / prompt_logprobs_rows: greedy, seeded and batch-independent draws, filters, logprobs."""

import math

import pytest
import torch

from epserve.models.traits import RowSampling, logprob_of
from epserve.worker.sampler import mix_seed, prompt_logprobs_rows, sample_rows

V = 50


def logits_batch(rows: int, seed: int = 0, v: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, v, generator=g) * 3


def ids(tokens):
    return [t.token_id for t in tokens]


def test_greedy_is_argmax_with_low_id_ties():
    x = logits_batch(6)
    x[5] = 0.0
    x[5, 7] = x[5, 3] = 1.0
    out = sample_rows(x, [RowSampling(temperature=0.0)] * 6, [0] * 6)
    assert ids(out) == x[:5].argmax(-1).tolist() + [3]
    assert all(t.logprob == 0.0 and t.top == () for t in out)


def test_plain_greedy_batch_draws_what_the_general_draw_does():
    """A batch of plain greedy rows skips the Gumbel draw (argmax alone): the same tokens as
    the same rows drawn with it (asking for logprobs takes the general path), ties and rows
    of -inf included."""
    x = logits_batch(4)
    x[1] = 0.0
    x[1, 9] = x[1, 4] = 2.0
    x[2] = -math.inf
    x[3, 11] = x[3].max()
    fast = ids(sample_rows(x, [RowSampling(temperature=0.0)] * 4, [0] * 4))
    general = ids(sample_rows(x, [RowSampling(temperature=0.0, logprobs=0)] * 4, [0] * 4))
    assert fast == general
    assert fast[1] == 4 and fast[2] == 0 and fast[3] == min(11, int(x[3].argmax()))


def test_banned_ids_apply_to_greedy_and_are_never_sampled():
    x = logits_batch(1).repeat(2, 1)
    top2 = x[0].topk(2).indices.tolist()
    out = sample_rows(x[:1], [RowSampling(temperature=0.0, banned_token_ids=(top2[0],))], [0])
    assert ids(out) == [top2[1]]
    x = torch.zeros(1, 5)
    x[0, 1] = 8.0
    banned = (1, 3)
    rows = [RowSampling(temperature=1.0, seed=s, banned_token_ids=banned) for s in range(300)]
    drawn = ids(sample_rows(x.repeat(300, 1), rows, [0] * 300))
    assert not set(drawn) & set(banned) and len(set(drawn)) == 3


def test_seeded_rows_reproducible_and_independent_of_batch():
    x = logits_batch(8, seed=1)
    rows = [RowSampling(temperature=1.3, top_p=0.95, top_k=20 if i % 2 else 0, min_p=0.01 * (i % 3), seed=100 + i)
            for i in range(8)]
    idx = list(range(10, 18))
    base = ids(sample_rows(x, rows, idx))
    assert base == ids(sample_rows(x, rows, idx))
    perm = [3, 7, 0, 5, 1, 6, 2, 4]
    permuted = ids(sample_rows(x[perm], [rows[i] for i in perm], [idx[i] for i in perm]))
    assert permuted == [base[i] for i in perm]
    # Alone, or next to greedy rows, each row draws the same token.
    for i in (0, 5):
        assert ids(sample_rows(x[i:i + 1], [rows[i]], [idx[i]])) == [base[i]]
    mixed = torch.cat([x[2:3], logits_batch(2, seed=9)])
    got = sample_rows(mixed, [rows[2], RowSampling(temperature=0.0), RowSampling(seed=5)], [idx[2], 0, 0])
    assert got[0].token_id == base[2]


def test_different_seeds_and_indices_differ():
    x = torch.zeros(1, 1000)
    rows = [RowSampling(temperature=1.0, seed=s) for s in range(20)]
    by_seed = ids(sample_rows(x.repeat(20, 1), rows, [0] * 20))
    assert len(set(by_seed)) > 15
    by_index = ids(sample_rows(x.repeat(20, 1), [rows[0]] * 20, list(range(20))))
    assert len(set(by_index)) > 15
    assert mix_seed(1, 2) != mix_seed(2, 1) and 0 <= mix_seed(-5, 3) < 2 ** 64


def test_low_temperature_concentrates():
    x = logits_batch(1, seed=2).repeat(200, 1)
    best = int(x[0].argmax())
    cold = ids(sample_rows(x, [RowSampling(temperature=0.05, seed=s) for s in range(200)], [0] * 200))
    hot = ids(sample_rows(x, [RowSampling(temperature=5.0, seed=s) for s in range(200)], [0] * 200))
    assert cold.count(best) >= 195
    assert hot.count(best) < 100


@pytest.mark.parametrize("knob", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_extreme_filters_equal_greedy(knob):
    x = logits_batch(16, seed=3)
    rows = [RowSampling(temperature=2.0, seed=s, **knob) for s in range(16)]
    assert ids(sample_rows(x, rows, list(range(16)))) == x.argmax(-1).tolist()


def test_top_k_and_min_p_filter():
    x = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]])).repeat(400, 1)
    topk = ids(sample_rows(x, [RowSampling(seed=s, top_k=2) for s in range(400)], [0] * 400))
    assert set(topk) == {0, 1}
    # min_p 0.2: tokens below 0.2 * 0.4 = 0.08 go (ids 3 and 4).
    minp = ids(sample_rows(x, [RowSampling(seed=s, min_p=0.2) for s in range(400)], [0] * 400))
    assert set(minp) == {0, 1, 2}
    # top_p 0.65: 0.4 + 0.3 covers it, so ids {0, 1} survive.
    topp = ids(sample_rows(x, [RowSampling(seed=s, top_p=0.65) for s in range(400)], [0] * 400))
    assert set(topp) == {0, 1}


def test_frequencies_match_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    p = torch.softmax(logits, 0).tolist()
    n = 4000
    drawn = ids(sample_rows(logits.repeat(n, 1), [RowSampling(seed=7)] * n, list(range(n))))
    chi2 = sum((drawn.count(i) - n * p[i]) ** 2 / (n * p[i]) for i in range(5))
    assert chi2 < 25  # 4 degrees of freedom: p < 1e-4 for a correct sampler


def test_logprobs_are_raw_log_softmax():
    x = logits_batch(4, seed=4)
    x[1, 10] = x[1, 20] = 50.0  # a tie at the top: the lower id comes first
    rows = [RowSampling(temperature=0.7, seed=1, logprobs=5, top_k=3, banned_token_ids=(0,)),
            RowSampling(temperature=0.0, logprobs=3),
            RowSampling(temperature=1.0, seed=2),
            RowSampling(temperature=0.0, logprobs=0)]
    out = sample_rows(x, rows, [0, 1, 2, 3])
    lsm = torch.log_softmax(x, -1)
    for i in (0, 1, 3):
        t = out[i]
        want_lp, want_top = logprob_of(x[i].tolist(), t.token_id, rows[i].logprobs)
        assert t.logprob == pytest.approx(float(lsm[i, t.token_id]), abs=1e-5)
        assert t.logprob == pytest.approx(want_lp, abs=1e-5)
        assert [a for a, _ in t.top] == [a for a, _ in want_top]
        assert [b for _, b in t.top] == pytest.approx([b for _, b in want_top], abs=1e-5)
    assert out[1].token_id == 10 and [a for a, _ in out[1].top][:2] == [10, 20]
    assert len(out[0].top) == 5 and out[3].top == ()
    assert out[2].logprob == 0.0 and out[2].top == ()


def test_prompt_logprobs_rows():
    x = logits_batch(5, seed=6)
    targets = [3, 0, 49, 7, V + 2]
    got = prompt_logprobs_rows(x, targets, 4)
    for i, t in enumerate(targets):
        want_lp, want_top = logprob_of(x[i].tolist(), t, 4)
        assert got[i].token_id == t
        if math.isinf(want_lp):
            assert math.isinf(got[i].logprob) and got[i].logprob < 0
        else:
            assert got[i].logprob == pytest.approx(want_lp, abs=1e-5)
        assert [a for a, _ in got[i].top] == [a for a, _ in want_top]
        assert [b for _, b in got[i].top] == pytest.approx([b for _, b in want_top], abs=1e-5)
    assert prompt_logprobs_rows(x[:2], [1, 2], 0)[0].top == ()
    assert prompt_logprobs_rows(x[:0], [], 3) == []


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError):
        sample_rows(logits_batch(2), [RowSampling()], [0, 0])
    with pytest.raises(ValueError):
        prompt_logprobs_rows(logits_batch(2), [1], 1)
