"""Which captured decode graph a step of n rows replays (pure host logic; the graphs themselves
are tested on a GPU in tests/gpu/test_cuda_graphs.py)."""

from __future__ import annotations

from epserve.models.traits import DECODE_BATCH_LADDER, padded_batch_n
from epserve.worker.cuda_graphs import ABOVE_LADDER_STEP, graph_batch


def test_on_the_ladder_it_is_padded_batch_n():
    for n in range(2, DECODE_BATCH_LADDER[-1] + 1):
        assert graph_batch(n) == padded_batch_n(n) >= n


def test_one_row_is_not_padded():
    """A padding row would route to its own experts: one row replays a one-row graph."""
    assert padded_batch_n(1) == 2 and graph_batch(1) == 1


def test_above_the_ladder_it_pads_to_the_next_step():
    assert ABOVE_LADDER_STEP == 32
    assert [graph_batch(n) for n in (129, 160, 161, 255, 256, 257)] == [160, 160, 192, 256, 256, 288]
