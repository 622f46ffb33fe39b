"""A live epserve server for the HTTP tests: Ray Serve on 127.0.0.1 and a free port, started
once per session over the demo model, with an API key; and the offline LLM to compare with."""

from __future__ import annotations

from pathlib import Path

import pytest
from serverkit import (API_KEY, APP_NAME, BODY_READ_TIMEOUT_S, HEADER_READ_TIMEOUT_S, HEAD_NAME,
                       Server, delete_app, free_port, plan_side_apps, side_app, side_app_base,
                       stop_side_heads)


_HERE = Path(__file__).parent
_CLEANUPS: list = []


def _cleanup() -> None:
    while _CLEANUPS:
        _CLEANUPS.pop()()


def pytest_collection_modifyitems(session, config, items):
    """The HTTP tests that need no cluster of this session (``serve run`` and ``epserve serve``
    start their own, the config checks none) run first, before this session's Ray cluster and
    server start: their own clusters then do not share the 2 cores with an idle Serve app and
    its cluster (up to the last HTTP test either way)."""
    ours = [i for i, item in enumerate(items) if _HERE in Path(str(item.path)).parents]
    first = [items[i] for i in ours if "ray_cluster" not in _fixture_names(items[i])]
    rest = [items[i] for i in ours if "ray_cluster" in _fixture_names(items[i])]
    for i, item in zip(ours, first + rest):
        items[i] = item


def _fixture_names(item) -> tuple[str, ...]:
    return tuple(getattr(item, "fixturenames", ()))


def pytest_runtest_teardown(item, nextitem):
    """Stop the server after the last HTTP test, not at the end of the whole session: the
    tests of other folders should not share the machine with an idle Serve app."""
    if nextitem is None or _HERE not in Path(str(nextitem.path)).parents:
        _cleanup()


@pytest.fixture(scope="session")
def server(ray_cluster, demo_model_dir, request) -> Server:
    from ray import serve

    from epserve.cluster.bringup import stop_head
    from epserve.deploy.app import build_app
    from epserve.deploy.proxy_edge import serve_start

    port = free_port()
    serve_start({"host": "127.0.0.1", "port": port}, header_read_timeout_s=HEADER_READ_TIMEOUT_S)
    app = build_app({"model": str(demo_model_dir), "dtype": "float32", "seed": 0,
                     "served_model_name": "demo", "api_key": API_KEY, "head_name": HEAD_NAME,
                     "max_body_bytes": 1 << 20, "body_read_timeout_s": BODY_READ_TIMEOUT_S})
    _CLEANUPS.append(lambda: stop_head(HEAD_NAME))
    _CLEANUPS.append(serve.shutdown)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    # the first app beside it that the selected tests use starts now (serverkit.side_app)
    _CLEANUPS.insert(0, stop_side_heads)  # after serve.shutdown
    plan_side_apps(request.session.items, request.getfixturevalue)
    yield Server(f"http://127.0.0.1:{port}", "demo", API_KEY)
    _cleanup()


@pytest.fixture(scope="session")
def offline_llm(demo_model_dir):
    """The offline API over the same folder and options as the server's engine."""
    from epserve import LLM

    return LLM(model=str(demo_model_dir), dtype="float32", seed=0)


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0, timeout=120)


SCRIPTED_APP, SCRIPTED_HEAD, SCRIPTED_PREFIX = ("epserve-http-scripted", "epserve-head-scripted",
                                                "/scripted")


def _scripted_config(getfixture) -> dict:
    from scripted_model import build

    ckpt = build(getfixture("tmp_path_factory").mktemp("scripted") / "model",
                 getfixture("demo_model_dir"))
    return {"model": str(ckpt), "dtype": "float32", "seed": 0, "max_num_seqs": 8,
            "served_model_name": "scripted", "api_key": API_KEY, "head_name": SCRIPTED_HEAD,
            "enable_auto_tool_choice": True, "tool_call_parser": "hermes",
            "reasoning_parser": "qwen3", "return_tokens_as_token_ids": True,
            "max_logprobs": -1}


side_app("scripted_server", SCRIPTED_APP, SCRIPTED_PREFIX, _scripted_config)


@pytest.fixture(scope="session")
def scripted_server(server, request) -> Server:
    """A second app beside ``server``, under /scripted: the scripted model (scripted_model.py:
    its greedy text is a script) served as ``epserve serve --enable-auto-tool-choice
    --tool-call-parser hermes --reasoning-parser qwen3 --return-tokens-as-token-ids
    --max-logprobs -1`` would."""
    from epserve.cluster.bringup import stop_head

    _CLEANUPS.append(lambda: stop_head(SCRIPTED_HEAD))
    _CLEANUPS.append(lambda: delete_app(SCRIPTED_APP))  # runs first: the app, then its head
    base = side_app_base("scripted_server", server, request.getfixturevalue, "the scripted app")
    yield Server(base, "scripted", API_KEY)


@pytest.fixture(scope="session")
def scripted_client(scripted_server):
    import openai

    return openai.OpenAI(base_url=scripted_server.v1, api_key=scripted_server.api_key,
                         max_retries=0, timeout=120)
