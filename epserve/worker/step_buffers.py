"""The memory a step's flattened inputs are written into, and its tensor views.

One step's inputs are one int64 buffer (``worker.batch``'s layout: ids | positions | KV slots |
sample index | state slots, then int32 seq lens | block tables), written on the host with numpy
and, on CUDA, copied to the device in one go. ``StepBuffers`` keeps a ring of such buffers for
the steps of one Runner instead of allocating (pinned) host and device memory per step, and cuts
each layout's tensor views once per buffer instead of per step (at a few hundred rows a step's
host time is per-call overhead, and a steady decode batch repeats its layout for many steps).

Invariants: a buffer is rewritten only after its last copy to the device has run (its CUDA
event), so a queued forward (the decode lookahead's) still reads the inputs it was given; the
device twin of a buffer is rewritten only by a copy queued after every forward that reads it
(one stream); a buffer grows (and drops its views) when a step needs more; every section of a
layout starts 16-byte aligned from the buffer's start (Triton specializes kernels on pointer
alignment). With ``reuse=False`` every take is fresh memory, as a caller whose inputs must
outlive the ring needs (the MTP drafter's chained passes).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

RING = 3  # buffers in turn: a step, the lookahead's next step, and one spare
_MAX_CUTS = 64  # layouts remembered per buffer


def align(n: int, k: int) -> int:
    return -(-n // k) * k


def i32_offset(n: int, nr: int, ns: int, states: bool) -> int:
    """Where the int32 part starts, in int64 words: ids, positions, KV slots (``align(n, 2)``
    each), the sample index (``align(nr, 2)``), the state slots (``align(ns, 2)``)."""
    return 3 * align(n, 2) + align(nr, 2) + (align(ns, 2) if states else 0)


class Cut:
    """One layout in one buffer: numpy views to write (``v64``: the int64 part, ``v32``: the
    int32 part) and the device tensors the forward reads; ``ship`` copies the written words
    to the device (CUDA) and marks the copy."""

    __slots__ = ("buf", "total", "v64", "v32", "ids", "pos", "kv", "sample", "state_slots",
                 "lens", "tables")

    def __init__(self, buf: "_Buffer", n: int, nr: int, ns: int, width: int, states: bool):
        off = i32_offset(n, nr, ns, states)
        self.buf, self.total = buf, off + (align(ns, 4) + ns * width + 1) // 2
        self.v64, self.v32 = buf.arr[:off], buf.arr[off:self.total].view(np.int32)
        d = buf.dev
        n2, ns4, at = align(n, 2), align(ns, 4), 3 * align(n, 2) + align(nr, 2)
        d32 = d[off:self.total].view(torch.int32)
        self.ids, self.pos, self.kv = d[:n], d[n2:n2 + n], d[2 * n2:2 * n2 + n]
        self.sample = d[3 * n2:3 * n2 + nr]
        self.state_slots = d[at:at + ns] if states else None
        self.lens, self.tables = d32[:ns], d32[ns4:ns4 + ns * width].view(ns, width)

    def ship(self) -> None:
        buf = self.buf
        if buf.event is not None:  # CUDA: one copy of the words written, then its mark
            buf.dev[:self.total].copy_(buf.host[:self.total], non_blocking=True)
            buf.event.record()


class _Buffer:
    __slots__ = ("host", "arr", "dev", "event", "cuts")

    def __init__(self, words: int, device: torch.device):
        with torch.inference_mode(False):  # plain tensors: views and copies in and out of it
            pin = device.type == "cuda"
            self.host = torch.empty(words, dtype=torch.int64, pin_memory=pin)
            self.dev = torch.empty(words, dtype=torch.int64, device=device) if pin else self.host
        self.arr = self.host.numpy()
        self.event: Any = torch.cuda.Event() if pin else None
        self.cuts: dict[tuple, Cut] = {}


class StepBuffers:
    """A Runner's step-input buffers (see the module's invariants)."""

    def __init__(self, device: torch.device, reuse: bool = True):
        self.device, self.reuse = device, reuse
        self._ring: list[_Buffer | None] = [None] * RING
        self._at = 0

    def take(self, n: int, nr: int, ns: int, width: int, states: bool) -> Cut:
        """The next buffer, free to write, cut for ``n`` tokens, ``nr`` sampled rows, ``ns``
        sequences with block tables ``width`` wide (``states``: with state slots)."""
        key = (n, nr, ns, width, states)
        words = i32_offset(n, nr, ns, states) + (align(ns, 4) + ns * width + 1) // 2
        if not self.reuse:
            with torch.inference_mode(False):
                return Cut(_Buffer(words, self.device), *key)
        i, buf = self._at, self._ring[self._at]
        self._at = (i + 1) % RING
        if buf is not None and buf.event is not None:
            buf.event.synchronize()  # its last copy has run (at once, but for a lookahead's)
        if buf is None or buf.arr.shape[0] < words:
            grown = words if buf is None else max(words, 2 * buf.arr.shape[0])
            buf = self._ring[i] = _Buffer(grown, self.device)
        cut = buf.cuts.get(key)
        if cut is None:
            if len(buf.cuts) >= _MAX_CUTS:
                buf.cuts.clear()
            with torch.inference_mode(False):
                cut = buf.cuts[key] = Cut(buf, *key)
        return cut
