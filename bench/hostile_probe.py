"""Hostile-input and fault probe of the epserve HTTP server, with counts (issue 14's figures).

Starts its own local Ray cluster and Serve app (the demo model, or ``--model``; float32, an API
key, a 3 s header deadline and a 3 s body deadline), then attacks it as a hostile or careless
client would, and prints one table last: per probe family, requests tried, answered 2xx, 4xx in
OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``, 4xx in another shape,
5xx, hangs (no whole answer within the per-request deadline), connection errors (refused,
reset, closed without an answer), mismatches (an answer other than the expected one: a 2xx for
an invalid request, a wrong key let in, tokens that differ from the offline ``LLM``), and notes
(recovery times for the fault rows). Above the table: every finding, with the request that
caused it and what came back.

Families (rows; the helpers are bench/probe_*.py):
  fuzz-*      (no server) 20,000 mutated, random, random-record and hostile-msgpack frames into
              the EP step-command and rank-result decoders: ProtocolError / other exception /
              accepted (its rows then built), peak tracemalloc memory against frame size
  bodies*     malformed JSON, every JSON type in every field of both generation routes,
              NaN / Infinity / huge numbers, deep nesting, lone surrogates, empty and non-object
              bodies, unknown models, invalid token ids, bodies over 1 MiB (declared, chunked,
              lying), huge n (alone, /health polled meanwhile) / logprobs / max_tokens,
              thousands of stop strings, out-of-vocabulary stop_token_ids, top_k far above the
              vocabulary; then 300 requests of random sampling fields (fixed seed)
  protocol    raw sockets: malformed request lines, NUL in headers, duplicate Content-Length,
              bad chunking, heads over 64 KiB, other methods, pipelining
  auth        every key variant on every route (/health open, the rest 401 without the exact
              key), paths that try to get round the key, text/plain POSTs
  slow        idle, stalled and dribbled heads and bodies (408 within the deadline, closed),
              150 held connections, clients that drop a stream or a request
  concurrency 64 greedy streams beside hostile-but-valid ones (256 stop strings, n=8 seeded,
              logprobs=20, echo + prompt_logprobs, n=32) and 8 streams nobody reads, every token
              compared with the offline LLM; stream-vs-plain: the same without stream
  idle        (ep_size 2) no requests for 130 s: /health must stay 200
  ep-kill / ep-sigstop   (ep_size 2) a rank killed / frozen under 16 streams: time to 503,
              /health latency, time to 200 again, how the streams ended (tokens compared), and
              requests sent during the re-form

Run on the CPU machine (about 5 minutes; ``--quick`` about 1.5: fewer requests, no idle wait,
the kill only)::

    python bench/hostile_probe.py [--ep-size 2] [--quick] [--model PATH] [--log FILE]
                                  [--idle-s S] [--unsafe]

Exit status 0 when nothing was found (no 5xx, non-OpenAI 4xx, hang, unexpected connection
error or mismatch), 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_kit import MemWatch, Tally, Target, get, render, render_findings  # noqa: E402

API_KEY = "probe-key-7f3a9c"
HEAD_NAME = "epserve-head-hostile-probe"
APP_NAME = "epserve-hostile-probe"
HEADER_S = 3.0
BODY_S = 3.0


def _env() -> None:
    for k, v in (("TOKENIZERS_PARALLELISM", "false"), ("HF_HUB_OFFLINE", "1"),
                 ("TRANSFORMERS_OFFLINE", "1"), ("GLOO_SOCKET_IFNAME", "lo"),
                 ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    os.environ.pop("RAY_ADDRESS", None)  # our own local cluster, never someone else's


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, ep_size: int, cleanups: list) -> Target:
    """A local Ray cluster and the Serve app over ``model``; returns once /health is 200."""
    from ray import serve

    from epserve.cluster.bringup import init_ray, stop_head
    from epserve.deploy.app import build_app
    from epserve.deploy.proxy_edge import serve_start

    init_ray(num_cpus=4)
    port = _free_port()
    cleanups.append(lambda: stop_head(HEAD_NAME))
    cleanups.append(serve.shutdown)
    serve_start({"host": "127.0.0.1", "port": port}, header_read_timeout_s=HEADER_S)
    app = build_app({"model": model, "dtype": "float32", "seed": 0, "ep_size": ep_size,
                     "served_model_name": "demo", "api_key": API_KEY, "head_name": HEAD_NAME,
                     "max_body_bytes": 1 << 20, "body_read_timeout_s": BODY_S})
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    t = Target("127.0.0.1", port, "demo", API_KEY, HEADER_S, BODY_S)
    deadline = time.monotonic() + 300
    while get(t, "/health", 5.0, key=False).status != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not become healthy within 300 s")
        time.sleep(0.5)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    max_len = get(t, "/v1/models").json()["data"][0]["max_model_len"]
    return dataclasses.replace(t, vocab=vocab, max_len=max_len)


def _cleanup(cleanups: list) -> None:
    import ray

    while cleanups:
        fn = cleanups.pop()
        try:
            fn()
        except Exception as exc:  # best effort: the rest must still run
            print(f"cleanup: {type(exc).__name__}: {exc}", file=sys.stderr)
    if ray.is_initialized():
        ray.shutdown()


def _stage(stages: list, mem, name: str, fn, *args) -> None:
    """Run one family; remember its time and the peak memory of the server's processes."""
    t0 = time.monotonic()
    print(f"[probe] {name} ...", file=sys.stderr, flush=True)
    mem.take()
    try:
        fn(*args)
    finally:
        took = time.monotonic() - t0
        print(f"[probe] {name} done in {took:.1f}s", file=sys.stderr, flush=True)
        stages.append(f"  {name}: {took:.0f}s; peak RSS {mem.take() or '-'}")


def _families(args, tally: Tally, stages: list, cleanups: list) -> None:
    import probe_bodies
    import probe_fuzz
    import probe_load
    import probe_protocol
    from epserve.models.demo import demo_model_path

    mem = MemWatch({"ingress": f"ServeReplica:{APP_NAME}", "head": "ray::HeadActor",
                    "rank": "ray::EpWorker", "proxy": "ray::ProxyActor"})
    # the fuzz traces every allocation of the process: before the sampler thread starts
    _stage(stages, mem, "fuzz", probe_fuzz.run, tally, 2_000 if args.quick else 20_000)
    mem.start()
    cleanups.append(mem.stop.set)
    model = args.model or str(demo_model_path(progress=False))
    t0 = time.monotonic()
    target = start_server(model, args.ep_size, cleanups)
    stages.append(f"  server start: {time.monotonic() - t0:.0f}s (port {target.port})")
    offline = probe_load.Offline(model)
    _stage(stages, mem, "bodies", probe_bodies.run, tally, target, args.quick, args.unsafe)
    _stage(stages, mem, "protocol", probe_protocol.run, tally, target, args.quick)
    _stage(stages, mem, "concurrency", probe_load.concurrency, tally, target, offline,
           args.quick)
    if args.idle_s > 0:
        _stage(stages, mem, "idle", probe_load.idle, tally, target, args.idle_s)
    if args.ep_size > 1:
        for fault in ("kill",) if args.quick else ("kill", "sigstop"):
            _stage(stages, mem, f"ep-{fault}", probe_load.ep_fault, tally, target, offline,
                   fault, HEAD_NAME, args.quick, cleanups)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ep-size", type=int, default=2, help="EP ranks (1 skips the fault rows)")
    ap.add_argument("--quick", action="store_true", help="fewer requests, one fault (~2 min)")
    ap.add_argument("--model", help="a checkpoint folder (default: the built-in demo model)")
    ap.add_argument("--unsafe", action="store_true",
                    help="also send n=10**9 and 2**31-1, which exhaust the machine's memory "
                         "if the server allocates per choice before checking max_n")
    ap.add_argument("--idle-s", type=float, default=None,
                    help="leave the server idle this long, polling /health (default 130, "
                         "past the EP group's 120 s collective timeout; 0 with --quick)")
    ap.add_argument("--log", help="write every answer counted to this file (TSV)")
    args = ap.parse_args(argv)
    if args.idle_s is None:
        args.idle_s = 0.0 if args.quick or args.ep_size == 1 else 130.0
    _env()
    signal.signal(signal.SIGTERM, _interrupt)
    log = open(args.log, "w") if args.log else None
    tally, stages, cleanups, t_start = Tally(log), [], [], time.monotonic()
    try:
        _families(args, tally, stages, cleanups)
    except KeyboardInterrupt:
        print("[probe] interrupted: cleaning up", file=sys.stderr)
        stages.append("  INTERRUPTED: the counts are partial")
    finally:
        _cleanup(cleanups)
        if log is not None:
            log.close()
    print(render_findings(tally))
    print(f"\nhostile probe: ep_size={args.ep_size}{' quick' if args.quick else ''}, "
          f"{time.monotonic() - t_start:.0f}s")
    print("\n".join(stages) + "\n")
    print(render(tally))
    return 1 if tally.findings else 0


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
