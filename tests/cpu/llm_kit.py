"""Shared by the offline-API error tests: prompt and sampling shorthands, a hang guard, and
the check that an engine is left idle (their ``llm`` fixture is in this folder's conftest)."""

from __future__ import annotations

import threading

import pytest

from epserve import LLM, SamplingParams


def _ids(p: list[int]) -> dict:
    return {"prompt_token_ids": p}


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def _within(seconds: float, fn, *args, **kwargs):
    """Run ``fn`` in a thread; fail (not hang) when it does not return in ``seconds``."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not return within {seconds}s (hang)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished()
    assert llm.engine.requests == {}
    pool = llm.model.pool
    assert llm.model.num_free_blocks() + pool.num_cached_free_blocks() == llm.model.num_total_blocks()
