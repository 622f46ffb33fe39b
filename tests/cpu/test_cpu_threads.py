"""An engine actor's process on a CPU device: half the cores for torch, normal priority; a
serving process's start frozen out of the collector's generations.

Run in a child process (started at nice 10, as Ray starts its workers at nice 15) so the test
process's own thread pool and priority stay as they are."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = """
import json, os, torch
from epserve.cluster.cpu_threads import set_engine_threads
before = torch.get_num_threads()
set_engine_threads({device!r})
print(json.dumps({{"before": before, "after": torch.get_num_threads(),
                  "nice": os.getpriority(os.PRIO_PROCESS, 0)}}))
"""


def _child(device: str, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", CHILD.format(device=device)], env=env,
                         preexec_fn=lambda: os.nice(10), capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cpu_engine_takes_half_the_cores_and_normal_priority():
    cores = len(os.sched_getaffinity(0))
    got = _child("cpu", threads=max(2, cores))
    assert got["before"] == max(2, cores)
    assert got["after"] == max(1, cores // 2)
    # Raising priority needs the privilege (root here and in CI); without it nothing changes.
    assert got["nice"] == (0 if os.geteuid() == 0 else 10)


def test_fewer_threads_than_half_are_left_alone():
    got = _child("cpu", threads=1)
    assert got["after"] == 1


FREEZE_CHILD = """
import gc, json, weakref
from epserve.cluster.cpu_threads import freeze_heap

class Engine:  # what a serving process builds at start: objects in reference cycles
    def __init__(self):
        self.me = self
old = Engine()
ref = weakref.ref(old)
freeze_heap()
frozen = gc.get_freeze_count()
gc.collect()
kept = ref() is not None  # alive and referenced: a collection leaves it alone
del old  # a rebuild drops it; its cycle is frozen with the heap
gc.collect()
leaked = ref() is not None  # the collector does not see it while frozen
freeze_heap()  # the rebuilt process freezes again: the old cycle is collected first
print(json.dumps({"frozen": frozen, "kept": kept, "leaked": leaked,
                  "freed": ref() is None, "again": gc.get_freeze_count()}))
"""


def test_freeze_heap_hides_the_start_from_collections_and_releases_a_rebuilt_engine():
    out = subprocess.run([sys.executable, "-c", FREEZE_CHILD], capture_output=True, text=True,
                         timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["frozen"] > 1000 and got["kept"]
    assert got["leaked"] and got["freed"] and got["again"] > 1000
