"""An engine actor's process on a CPU device: half the cores for torch, normal priority.

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
