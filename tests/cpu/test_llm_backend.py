"""Both engines behind ``LLM`` speak the whole ``LlmBackend`` protocol, and ``LLM`` keeps no
test hooks of its own: the EP hooks are the remote backend's (``llm.backend.worker_handles()``)."""

from __future__ import annotations

import inspect

from epserve import LLM
from epserve.cluster.llm_backend import LlmBackend, LocalBackend
from epserve.cluster.remote_engine import RemoteEngine

METHODS = [n for n, v in vars(LlmBackend).items() if inspect.isfunction(v) and n[0] != "_"]
ATTRIBUTES = list(LlmBackend.__annotations__)


def test_protocol_names_what_llm_calls():
    assert {"generate", "stream", "check_request", "capabilities", "beam_search", "stats",
            "health", "close"} == set(METHODS)
    assert {"tokenizer", "engine", "model"} == set(ATTRIBUTES)


def test_both_backends_implement_every_method_with_its_signature():
    for cls in (LocalBackend, RemoteEngine):
        for name in METHODS:
            want = list(inspect.signature(getattr(LlmBackend, name)).parameters)
            got = list(inspect.signature(getattr(cls, name)).parameters)
            assert got == want, (cls.__name__, name, got)


def test_local_backend_behind_llm(qwen3_ckpt):
    llm = LLM(model=str(qwen3_ckpt), dtype="float32")
    assert isinstance(llm.backend, LocalBackend)
    assert llm.engine is llm.backend.engine and llm.model is llm.backend.model
    assert llm.tokenizer is llm.backend.tokenizer
    assert llm.health() == {"healthy": True, "reason": None}
    assert llm.stats()["num_running"] == 0
    llm.close()
    llm.close()
    for hook in ("inject_command_fault", "worker_handles", "worker_failures"):
        assert not hasattr(llm, hook), hook
        assert callable(getattr(RemoteEngine, hook)), hook
