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
