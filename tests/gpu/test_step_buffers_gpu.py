"""The step inputs' ring on CUDA: pinned host buffers, each with a device twin, one copy per
step marked by an event. A buffer's host side is rewritten only after its last copy ran: with
the GPU held busy (each copy queued behind a sleep), the host comes back to a buffer before
its copy executed, must wait for it, and every step's device inputs are still that step's."""

from __future__ import annotations

import pytest
import torch

from epserve.worker.step_buffers import RING, StepBuffers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_buffer_is_rewritten_only_after_its_copy_ran():
    bufs = StepBuffers(torch.device("cuda"))
    seen = []
    for step in range(3 * RING):
        torch.cuda._sleep(5_000_000)  # the GPU busy: this step's copy runs later
        cut = bufs.take(64, 64, 64, 4, False)
        assert cut.buf.host.is_pinned() and cut.ids.is_cuda
        cut.v64[:] = step
        cut.v32[:] = step
        cut.ship()
        seen.append(torch.stack([cut.ids[-1], cut.tables[-1, -1].long()]))  # after the copy
    torch.cuda.synchronize()
    assert [s.tolist() for s in seen] == [[k, k] for k in range(3 * RING)]
