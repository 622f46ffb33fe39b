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
