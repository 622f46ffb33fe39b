"""Test-session setup: loopback only, quiet logs, tiny checkpoints built once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from tiny_ckpt import make_tiny_checkpoint  # noqa: E402


def _engine_threads() -> None:
    """The test process runs engines (one-rank LLMs), the transformers oracle and training
    beside the Ray cluster's processes, subprocesses and, on a shared VM, other work: it
    takes an engine process's torch intra-op threads (``epserve.cluster.cpu_threads``: half
    the cores, one on the 2-core CI VM), as the head and rank actors do. With two threads each
    tiny op's barrier waits for a core that another process holds: on the 2-core VM at load
    5, tests/cpu/test_spec_decode.py and test_spec_draft_model.py took 345 s with two and 20 s
    with one. Only the thread count changes: the tests that compare outputs compare them in
    this process, and the engine actors already run with these threads."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // 2)
    if torch.get_num_threads() > threads:
        torch.set_num_threads(threads)


_engine_threads()

# The tests that share the session's Ray cluster (tests/ray, tests/http, anything asking for
# ``ray_cluster``) and the rest are the two halves README's `pytest -n 2 --dist loadgroup` runs
# side by side (pytest-xdist): each half stays in one process, so one Ray cluster and one HTTP
# server serve a session as in a serial run (a split by file, tried in session 22, failed dozens
# of tests, not diagnosed). The halves take about the same time (session 23, 2-core VM: ~370 s
# and ~340 s alone, 441-470 s side by side against 735 s one after the other).
_RAY_DIRS = ("ray", "http")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        shares_ray = (item.path.parent.name in _RAY_DIRS
                      or "ray_cluster" in getattr(item, "fixturenames", ()))
        item.add_marker(pytest.mark.xdist_group("ray" if shares_ray else "local"))


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="session")
def mixtral_ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(scope="session", params=["qwen3_moe", "mixtral"])
def tiny_ckpt(request) -> Path:
    """Each architecture's tiny checkpoint in turn."""
    return request.getfixturevalue({"qwen3_moe": "qwen3_ckpt", "mixtral": "mixtral_ckpt"}[request.param])


@pytest.fixture(scope="session")
def trained_mtp_ckpt(tmp_path_factory) -> Path:
    """A tiny Qwen3.5 trained to count, with an MTP head trained to draft its picks."""
    from mtp_ckpt import make_trained_mtp_checkpoint

    return make_trained_mtp_checkpoint("qwen3_5_moe", tmp_path_factory.mktemp("trained_mtp"))


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster per test session, the one users get (loopback only, a per-cluster
    token, no dashboard); gloo on loopback."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.pop("RAY_ADDRESS", None)
    import ray

    from epserve.cluster.bringup import init_ray

    init_ray(num_cpus=4)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> Path:
    """The built-in demo model (real tokenizer, chat template), built once per session."""
    from epserve.models.demo import demo_model_path

    cache = tmp_path_factory.mktemp("epserve-cache")
    os.environ["EPSERVE_CACHE_DIR"] = str(cache)
    return demo_model_path(cache_dir=cache, progress=False)
