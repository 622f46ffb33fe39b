"""``epserve serve``: start (or join) Ray, deploy the OpenAI app, serve until Ctrl-C/SIGTERM.

Invariants: the engine is started (and its model loaded) before the HTTP app is deployed, so a
bad model path is one clear error, not a replica restart loop (Serve's controller and proxy
start while it loads); on the way out the app and the head are removed, and a Ray cluster this
command started is shut down — one it joined (``RAY_ADDRESS``) keeps its other applications.
The ingress (``--ingress``) is HAProxy (``haproxy_ingress``; no HAProxy of it outlives the
command) or Serve's Python proxy with ``proxy_edge``. ``auto`` (the default) takes HAProxy on a
cluster this command starts where HAProxy's binary runs (it streams ~4x cheaper a chunk, and on
an H200 it gave 0.88-0.93 of the offline rate against the proxy's 0.77-0.79, bench/RESULTS.md
session 20), else the proxy, saying why; ``haproxy`` is refused before Ray starts where it
cannot run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
from typing import Any

from epserve.cluster.engine_args import EngineArgs
from epserve.deploy.engine_flags import engine_options
from epserve.deploy.config import (
    API_KEY_ENV, DEFAULT_BODY_READ_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, AppConfig,
)
from epserve.deploy.proxy_edge import DEFAULT_HEADER_READ_TIMEOUT_S

APP_NAME = "epserve"


def config_from_args(args: argparse.Namespace) -> AppConfig:
    """The app config the ``serve`` subcommand's options describe."""
    # per-request limits: the flags when given, else EngineArgs's defaults
    limits = {k: getattr(args, k) for k in ("max_n", "max_stop_strings", "max_stop_chars",
                                            "max_stop_token_ids", "max_logit_bias",
                                            "max_logprobs")
              if getattr(args, k, None) is not None}
    engine = EngineArgs(**engine_options(args),
                        served_model_name=getattr(args, "served_model_name", None), **limits)
    # an EPSERVE_API_KEY that is set but blank is refused here, not taken as "no auth"
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    return AppConfig(engine=engine, api_key=key,
                     max_body_bytes=_given(args, "max_body_bytes", DEFAULT_MAX_BODY_BYTES),
                     body_read_timeout_s=_given(args, "body_read_timeout",
                                                DEFAULT_BODY_READ_TIMEOUT_S),
                     num_replicas=getattr(args, "api_server_count", 1),
                     enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
                     tool_call_parser=getattr(args, "tool_call_parser", None),
                     return_tokens_as_token_ids=getattr(args, "return_tokens_as_token_ids",
                                                        False))


def _given(args: argparse.Namespace, name: str, default: Any) -> Any:
    """The flag's value when given (0 included: AppConfig refuses it), else ``default``."""
    v = getattr(args, name, None)
    return default if v is None else v


def _check_port_free(host: str, port: int) -> None:
    """A clear error now, rather than a proxy that cannot bind later."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _wait_for_stop() -> None:
    """Block until SIGINT or SIGTERM."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


def _say(msg: str) -> None:
    print(f"epserve: {msg}", file=sys.stderr, flush=True)


def serve_main(args: argparse.Namespace) -> int:
    """Serve ``args`` (the ``serve`` subcommand's namespace) until Ctrl-C or SIGTERM."""
    import ray
    from ray import serve

    from epserve.cluster.bringup import init_ray, launch_head, stop_head
    from epserve.cluster.engine_args import check_model_path, check_reasoning_parser
    from epserve.deploy.app import build_app
    from epserve.deploy.proxy_edge import controller_options, serve_start

    cfg = config_from_args(args)
    resolved = cfg.engine_args().resolved()
    check_model_path(resolved.model)  # one clear line before Ray starts
    check_reasoning_parser(resolved)  # the thinking tags, likewise
    header_timeout_s = _given(args, "header_read_timeout", DEFAULT_HEADER_READ_TIMEOUT_S)
    controller_options(header_timeout_s)  # a bad deadline refused now, likewise
    joined = bool(os.environ.get("RAY_ADDRESS")) or ray.is_initialized()
    ingress = _ingress(getattr(args, "ingress", "auto"), header_timeout_s,
                       cfg.body_read_timeout_s, joined, args.host)
    # behind HAProxy, Serve's own listeners (the replicas', its fallback proxy) stay on loopback
    serve_host = args.host if isinstance(ingress, contextlib.nullcontext) else "127.0.0.1"
    if not joined:
        _check_port_free(args.host, args.port)
    with ingress:  # HAProxy's environment, before the cluster starts; its files after
        init_ray(engine_logs=True)  # the engine's lines (requests finished, periodic) here
        try:
            _say(f"loading {cfg.engine.model or 'the built-in demo model (random weights)'} ...")
            loaded = launch_head(cfg.engine_args(), cfg.head_name)  # it loads meanwhile
            # the proxy's own errors as OpenAI JSON, and a deadline on request heads
            serve_start({"host": serve_host, "port": args.port}, header_timeout_s)
            loaded()  # the engine's load error, if any, is this command's
            try:
                serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=False)
            except RuntimeError as exc:  # Serve's DeploymentFailed etc.: one line for the CLI
                raise ValueError(f"deploying the HTTP app failed: {exc}") from exc
            auth = "API key required" if cfg.api_key else "no API key"
            edge = "" if isinstance(ingress, contextlib.nullcontext) else "; HAProxy ingress"
            print(f"epserve: serving {cfg.served_model_name!r} at {_url(args.host, args.port)} "
                  f"({auth}{edge}); Ctrl-C to stop", flush=True)
            if cfg.engine.model is None:
                _say("the demo model's weights are random: its text is random")
            _wait_for_stop()
            _say("shutting down")
        finally:
            _shutdown(serve, joined, cfg, stop_head)
            if not joined:
                ray.shutdown()
    return 0


def _ingress(kind: str, header_timeout_s: float, body_timeout_s: float, joined: bool,
             host: str = "127.0.0.1") -> Any:
    """The context the cluster runs in for ``--ingress``: nothing for Serve's Python proxy,
    ``HaproxyIngress`` for HAProxy, its frontend on ``host`` (ValueError now when it cannot
    run); ``auto``: HAProxy where it can run on a cluster of this command, else the proxy."""
    binary = None
    if kind == "auto":
        binary = _auto_haproxy(joined)
        kind = "proxy" if binary is None else "haproxy"
    if kind == "proxy":
        if not joined and os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
            raise ValueError("RAY_SERVE_ENABLE_HA_PROXY=1 is set, but the ingress is Serve's "
                             "Python proxy (--ingress proxy): use --ingress haproxy, which "
                             "also sets HAProxy up for epserve, or unset the variable")
        return contextlib.nullcontext()
    if kind != "haproxy":
        raise ValueError(f"--ingress must be auto, haproxy or proxy, got {kind!r}")
    if joined:  # its settings are read by the cluster's processes as they start
        raise ValueError("--ingress haproxy sets up the local Ray cluster epserve serve starts; "
                         "on a cluster of yours (RAY_ADDRESS) set Serve's HAProxy up on its "
                         "nodes, or use --ingress proxy")
    from epserve.deploy.haproxy_ingress import HaproxyIngress, check

    return HaproxyIngress(binary or check(), header_timeout_s, body_timeout_s,
                          frontend_host=host)


def _auto_haproxy(joined: bool) -> str | None:
    """``--ingress auto``'s choice: HAProxy's binary where this command starts the cluster and
    that binary runs, else None, the proxy (on a cluster it joined, the nodes' own settings
    decide; where HAProxy cannot run, one line says why)."""
    if joined:
        return None
    from epserve.deploy.haproxy_ingress import check

    try:
        return check()
    except ValueError as exc:
        _say(f"HAProxy cannot take HTTP here ({exc}); Serve's Python proxy does")
        return None


def _shutdown(serve: Any, joined: bool, cfg: AppConfig, stop_head: Any) -> None:
    """Stop the app (its replicas drain), then the engine. On a local cluster the caller's
    ``ray.shutdown`` ends Serve's controller and proxy with it: ``serve.shutdown`` there
    killed the controller under its own retried graceful-shutdown task, and Ray printed that
    task's failure on every Ctrl-C."""
    try:
        serve.delete(APP_NAME)
    except Exception as exc:  # best effort: the cluster may already be going away
        _say(f"stopping the app: {exc}")
    try:
        stop_head(cfg.head_name)
    except Exception as exc:
        _say(f"stopping the engine: {exc}")
