"""Programmatic dependent launch (PDL) for every Triton kernel here, on Hopper and later.

A decode step is a few hundred small kernels back to back (393 at the Qwen3.5-35B-A3B shape),
each a few microseconds: the time between one kernel's end and the next one's start is a large
share of the step. With PDL a kernel may be launched while the one before it in the stream is
still running: its programs start, wait in ``gdc_wait`` until that kernel has finished and its
writes are visible, and so skip the launch latency instead of paying it after the previous
kernel's end. Every kernel here opens with

    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

before any load or store, so the overlap can never read what the previous kernel has not yet
written nor write what it still reads; ``gdc_launch_dependents`` then lets the next kernel start
launching once every program of this one has begun. (Written out in each kernel, not as a
shared ``triton.jit`` helper: a helper defined in another module may be of the other kind,
compiled or interpreted, when the CPU tests import kernels under the interpreter.) Kernels that
are not ours (torch's, cuBLAS) keep the stream's usual order around them. CUDA graph capture
keeps the dependencies as programmatic edges, so the decode graphs replay them the same way.

``pdl(kernel)`` is a launch's keyword arguments: on for a compiled (not interpreted) kernel on a
device of compute capability 9 or more, unless ``EPSERVE_PDL=0`` (read once a process: the A/B
switch for benchmarks); off under the Triton interpreter. Measured: bench/RESULTS.md (session
19).
"""

from __future__ import annotations

import functools
import os

import torch

from epserve.kernels.dispatch import interpreted

_OFF = {"PDL": False, "launch_pdl": False}
_ON = {"PDL": True, "launch_pdl": True}


@functools.cache
def pdl_device() -> bool:
    """Whether this process's kernels launch with PDL: an NVIDIA device of compute capability 9
    or more (the current one when first asked) and ``EPSERVE_PDL`` not ``0``. (Triton's
    ``launch_pdl`` and ``gdc_wait``: triton 3.3 and later, the floor in pyproject.toml.)"""
    if os.environ.get("EPSERVE_PDL", "1") == "0" or not torch.cuda.is_available() \
            or torch.version.hip is not None:  # (ROCm reports its own capability numbers)
        return False
    return torch.cuda.get_device_capability()[0] >= 9


def pdl(kernel) -> dict:
    """The launch keywords for ``kernel`` (a ``triton.jit`` kernel taking ``PDL``)."""
    return _ON if not interpreted(kernel) and pdl_device() else _OFF
