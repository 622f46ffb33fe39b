"""How a serving process (HeadActor, EpWorker, the ingress) uses the CPU: priority, torch
threads, and the garbage collector's view of what was built at start.

Invariants: an engine process runs at normal priority (Ray starts its workers at nice 15, below
every client and the proxy; raising it back needs the privilege to, else it stays as it is).
On a CPU device it uses at most half the machine's cores (at least one) for torch's intra-op
pool: the ingress, Serve's proxy and the clients share the machine. Measured on a 2-core VM, 64
concurrent streams of the demo model: 2 intra-op threads 380 tok/s over HTTP, 1 thread 775
(each op's thread barrier waits for a core that another process holds); nice 15 -> 0 another
+16% (875 -> 1,015). CUDA devices keep torch's threads (the GPU computes). Once built, a
serving process moves what is alive into the collector's permanent generation
(``freeze_heap``): its full collections then scan what serving allocates, not the ~200k
objects of the modules and the engine.
"""

from __future__ import annotations

import gc
import logging
import os

log = logging.getLogger(__name__)


def normal_priority() -> None:
    """Undo Ray's worker niceness for this process, where allowed."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except (OSError, AttributeError):  # not permitted, or not a POSIX system: keep it
        log.debug("cannot raise this process's priority", exc_info=True)


def set_engine_threads(device: str) -> None:
    """Normal priority, and on a CPU ``device`` torch intra-op threads capped at half the
    cores."""
    import torch

    from epserve.worker.runner_config import resolve_device

    normal_priority()
    if resolve_device(device).type != "cpu":
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // 2)
    if torch.get_num_threads() > threads:
        log.info("engine on CPU: %d torch threads of %d cores", threads, cores)
        torch.set_num_threads(threads)


def freeze_heap() -> None:
    """What is alive now (modules, model, engine) leaves the collector's generations: a full
    collection, which every request's objects reaching the oldest generation eventually
    triggers, then stops scanning it; it took ~74 ms on the demo model's offline engine (211k
    objects), a stall of every stream at once. Called again after a rebuild: what was frozen
    is released first, so the old engine's cycles are collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
