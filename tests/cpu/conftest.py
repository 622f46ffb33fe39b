"""Fixtures of the CPU tests of the offline API."""

from __future__ import annotations

import pytest

from epserve import LLM


@pytest.fixture(scope="module")
def shared_llm(qwen3_ckpt) -> LLM:
    return LLM(model=str(qwen3_ckpt), dtype="float32", seed=0, max_model_len=64)


@pytest.fixture
def llm(shared_llm):
    """The module's LLM; whatever a failing test left queued is aborted after it, so that
    one failure does not cascade into the next tests (each test checks ``_idle`` itself)."""
    yield shared_llm
    for rid in list(shared_llm.engine.requests):
        shared_llm.engine.abort_request(rid)
