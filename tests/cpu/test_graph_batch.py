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


def test_a_verify_graph_set_has_no_one_row_rung():
    """A verify step has a fed token and a draft at least: its set starts at two rows."""
    import torch

    from epserve.worker.cuda_graphs import DecodeGraphs

    cpu = torch.device("cpu")
    assert DecodeGraphs(None, cpu, 16, 8, 4, 3).rungs == [1, 2, 4, 8]
    assert DecodeGraphs(None, cpu, 16, 8, 4, 3, runs=True).rungs == [2, 4, 8]


def test_a_verify_graphs_runs_are_followed_by_its_padding():
    """What a verify graph's recurrent layers read at rung b for a step of n rows: the step's
    runs, then each padding row a held one-row run on the spare slot (it reads and writes no
    state), then empty held runs up to b (the rung's grid); a later, smaller step leaves none
    of the earlier one's runs behind."""
    import torch

    from epserve.kernels.attention import StateRuns
    from epserve.worker.cuda_graphs import RunsBuffers

    buf = RunsBuffers(16, torch.device("cpu"))
    buf.load(StateRuns((0, 1, 4, 7), [5, 2, 3], [False, False, True], (1, 2)).padded(8, 8, 99))
    slots, cu, fresh, hold = (t.tolist() for t in buf.views(8))
    assert slots == [5, 2, 3] + [99] * 5
    assert cu == [0, 1, 4, 7, 8] + [8] * 4  # run 3: the padding row 7; runs 4-7 empty
    assert fresh == [False, False, True] + [True] * 5
    assert hold == [False, True, True] + [True] * 5
    buf.load(StateRuns((0, 3), [4], [False], (0,)).padded(4, 4, 99))
    assert [t.tolist() for t in buf.views(4)] == [[4, 99, 99, 99], [0, 3, 4, 4, 4],
                                                  [False, True, True, True],
                                                  [True, True, True, True]]


def test_runs_that_do_not_fit_a_grid_are_refused():
    import pytest

    from epserve.kernels.attention import StateRuns

    runs = StateRuns((0, 1, 4, 7), [5, 2, 3], [False] * 3, (1, 2))
    with pytest.raises(ValueError, match="do not pad"):
        runs.padded(6, 8, 0)  # fewer rows than the runs cover
    with pytest.raises(ValueError, match="do not pad"):
        runs.padded(8, 3, 0)  # no run left for the padding row


def test_a_rungs_warm_up_and_capture_read_runs_over_its_own_rows():
    """Before a verify rung's warm-up and capture, its buffers hold placeholders over exactly
    its rows: b held one-row runs on the spare slot, and for its fold's grid of 2b runs those
    b then b empty runs. (The buffers start as one-row runs up to the largest grid: a fold of
    rung b warmed up on them read and wrote rows b..2b-1 of its b logged rows, an illegal
    memory access on the H200.)"""
    import torch

    from epserve.worker.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs(lambda *a: None, torch.device("cpu"), 4, 16, 2, spare_state_slot=9,
                          runs=True, fold=lambda logged, runs: None)
    for b in sorted(graphs.rungs, reverse=True):
        graphs.load_placeholders(b)
        slots, cu, fresh, hold = (t.tolist() for t in graphs._runs.views(b))
        assert (slots, cu, fresh, hold) == ([9] * b, list(range(b + 1)), [True] * b, [True] * b)
        slots, cu, fresh, hold = (t.tolist() for t in graphs._fold_runs.views(2 * b))
        assert cu == list(range(b + 1)) + [b] * b, b
        assert slots == [9] * (2 * b) and hold == [True] * (2 * b)
