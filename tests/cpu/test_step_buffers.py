"""The step inputs' ring (``worker.step_buffers``): a step's inputs are written into the next
of three reused buffers whose tensor views are cut once per layout; what a step hands out
stays intact until the ring comes back to its buffer; a layout that does not fit grows the
buffer; ``reuse=False`` is fresh memory every time. (The CUDA side, a pinned buffer with a
device twin and an event per copy, is tests/gpu/test_step_buffers_gpu.py.)"""

from __future__ import annotations

import numpy as np
import torch

from epserve.worker.step_buffers import RING, StepBuffers, i32_offset


def _fill(cut, value: int) -> None:
    cut.v64[:] = value
    cut.v32[:] = value
    cut.ship()


def test_a_steps_inputs_stay_until_the_ring_comes_back():
    bufs = StepBuffers(torch.device("cpu"))
    cuts = [bufs.take(8, 8, 8, 3, False) for _ in range(RING)]
    for i, c in enumerate(cuts):
        _fill(c, i + 1)
    assert [int(c.ids[0]) for c in cuts] == [1, 2, 3]  # three buffers, none shared
    again = bufs.take(8, 8, 8, 3, False)
    assert again is cuts[0]  # the same layout in the same buffer: its views, not new ones
    assert int(cuts[1].tables[2, 2]) == 2 and int(cuts[2].lens[7]) == 3


def test_views_cover_the_layout():
    """ids | positions | KV slots | sample index | state slots, then int32 lens | tables."""
    bufs = StepBuffers(torch.device("cpu"))
    n, nr, ns, width = 5, 3, 2, 4
    cut = bufs.take(n, nr, ns, width, True)
    off = i32_offset(n, nr, ns, True)
    cut.v64[:] = np.arange(off)
    cut.v32[:] = -np.arange(len(cut.v32))
    assert cut.ids.tolist() == [0, 1, 2, 3, 4] and cut.pos.tolist() == [6, 7, 8, 9, 10]
    assert cut.kv.tolist() == [12, 13, 14, 15, 16] and cut.sample.tolist() == [18, 19, 20]
    assert cut.state_slots.tolist() == [22, 23] and cut.lens.tolist() == [0, -1]
    assert cut.tables.shape == (ns, width) and cut.tables[0].tolist() == [-4, -5, -6, -7]
    assert cut.ids.data_ptr() % 16 == cut.tables.data_ptr() % 16 == 0  # sections aligned


def test_a_larger_layout_grows_the_buffer_and_fresh_takes_share_nothing():
    bufs = StepBuffers(torch.device("cpu"))
    small = [bufs.take(4, 4, 4, 1, False) for _ in range(RING)]
    big = bufs.take(4096, 16, 16, 64, False)  # the first buffer again, grown
    assert big.buf is not small[0].buf and len(big.v64) == i32_offset(4096, 16, 16, False)
    _fill(big, 7)
    assert int(big.ids[-1]) == 7 and int(big.tables[-1, -1]) == 7
    fresh = StepBuffers(torch.device("cpu"), reuse=False)
    a, b = fresh.take(4, 4, 4, 1, False), fresh.take(4, 4, 4, 1, False)
    assert a.buf is not b.buf
