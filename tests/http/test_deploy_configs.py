"""deploy/serve.yaml and deploy/cluster.yaml pass Ray's own validation, and `serve run
deploy/serve.yaml` really serves (its own Ray cluster on 127.0.0.1, killed after); when its
engine dies, /health and requests answer 503 instead of hanging."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import requests
import yaml
from serverkit import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
SERVE_YAML = ROOT / "deploy" / "serve.yaml"
CLUSTER_YAML = ROOT / "deploy" / "cluster.yaml"
BIN = Path(sys.executable).parent


def test_serve_yaml_passes_serve_schema_and_builds():
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    from epserve.deploy.app import build_app
    from epserve.deploy.config import AppConfig

    raw = yaml.safe_load(SERVE_YAML.read_text())
    schema = ServeDeploySchema.model_validate(raw)
    assert len(schema.applications) == 1
    app = schema.applications[0]
    ServeApplicationSchema.model_validate(raw["applications"][0])
    assert app.import_path == "epserve.deploy.app:build_app"
    cfg = AppConfig.from_dict(app.args)  # every arg is a known option with a valid value
    assert cfg.engine.model is None and cfg.served_model_name == "epserve-demo"
    assert build_app(app.args) is not None  # builds the Serve application, loads nothing


def test_cluster_yaml_passes_autoscaler_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load(CLUSTER_YAML.read_text())
    cfg = prepare_config(raw)
    validate_config(cfg)
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    gpu_types = [t for t in types.values() if t["resources"].get("GPU", 0) > 0]
    assert gpu_types and all(t["max_workers"] >= 1 for t in gpu_types)
    setup = " ".join(cfg["head_setup_commands"] + cfg["worker_setup_commands"])
    assert "pip install" in setup and "epserve" in setup
    start = " ".join(cfg["head_start_ray_commands"])
    assert "ray start --head" in start and "serve run" in start and "deploy/serve.yaml" in start
    assert "." in cfg["file_mounts"].values()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    return env


def _stop(proc: subprocess.Popen | None, sig: int, grace_s: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def _ctrl_c_as_in_a_terminal():
    """Processes started meanwhile get SIGINT as a terminal gives it (a KeyboardInterrupt).
    This process may ignore SIGINT (a shell's background job does, and so may a CI runner's),
    and an ignored signal stays ignored across exec: `serve run` then never saw its Ctrl-C
    (sat out the whole wait, then the 30 s drain)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def own_cluster(tmp_path):
    """A Ray head of its own (`ray start --block`, loopback, private temp dir) for a
    `serve run` subprocess; both ended by pid afterwards."""
    temp = tempfile.mkdtemp(prefix="ep", dir="/tmp")  # short: Ray's socket paths
    port = free_port()
    log = open(tmp_path / "ray-start.log", "w")
    # SIGTERM ends this head at once: Ray's drain on SIGTERM (for Kubernetes) otherwise waits
    # up to 30 s for Serve to move replicas off the node, and the whole 30 s whenever a Serve
    # app is still up there (a `serve run` that did not shut Serve down first)
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={port}", "--num-cpus=2", "--include-dashboard=false", f"--temp-dir={temp}",
         "--disable-usage-stats"], stdout=log, stderr=subprocess.STDOUT,
        env=dict(_env(), RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0"))
    try:
        yield f"127.0.0.1:{port}"
    finally:
        _stop(proc, signal.SIGTERM, 30)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


_KILL = """
import sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False)
sys.stdin.readline()  # the test's go
head = ray.get_actor(sys.argv[2], namespace="epserve")
ray.kill(head, no_restart=True)
for _ in range(100):  # return once it is really gone
    try:
        ray.get(head.ready.remote(), timeout=5)
    except ray.exceptions.RayActorError:
        sys.exit(0)
    time.sleep(0.2)
sys.exit("the head is still alive")
"""


def _head_killer(address: str, name: str) -> subprocess.Popen:
    """A driver that kills the named head of ``address`` when a line reaches its stdin: started
    beside `serve run`, it has imported Ray and joined the cluster by the time it is told."""
    return subprocess.Popen([sys.executable, "-c", _KILL, address, name], env=_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _kill_head(killer: subprocess.Popen) -> None:
    _, err = killer.communicate("kill\n", timeout=120)
    assert killer.returncode == 0, err[-3000:]


@pytest.mark.slow
def test_serve_run_serves_the_yaml_then_reports_a_dead_engine(own_cluster, demo_model_dir,
                                                              tmp_path):
    raw = yaml.safe_load(SERVE_YAML.read_text())
    port = free_port()
    raw["http_options"].update(host="127.0.0.1", port=port)
    raw["applications"][0]["args"].update(model=str(demo_model_dir), dtype="float32",
                                          served_model_name="yaml-demo", max_num_seqs=16)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve-run.log", "w")
    with _ctrl_c_as_in_a_terminal():
        proc = subprocess.Popen([str(BIN / "serve"), "run", "-a", own_cluster, str(cfg)],
                                stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
    killer = _head_killer(own_cluster, "epserve-head")
    try:
        def up():
            assert proc.poll() is None, (tmp_path / "serve-run.log").read_text()[-3000:]
            try:
                return requests.get(base + "/v1/models", timeout=5).status_code == 200
            except requests.RequestException:  # refused, or queued while deploying
                return False
        assert wait_for(up, timeout_s=240, every_s=0.2), "serve run never came up"
        assert requests.get(base + "/v1/models", timeout=30).json()["data"][0]["id"] == \
            "yaml-demo"
        r = requests.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "yaml-demo", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in (
            "stop", "length")
        assert requests.get(base + "/health", timeout=30).status_code == 200

        _kill_head(killer)
        h = wait_for(lambda: (lambda r: [r] if r.status_code == 503 else None)(
            requests.get(base + "/health", timeout=30)), timeout_s=30)
        assert h is not None and h[0].json()["error"]["type"] == "service_unavailable"
        r = requests.post(base + "/v1/completions", timeout=60, json={
            "prompt": "Hi", "max_tokens": 2, "stream": True})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        # Ctrl-C: `serve run` shuts Serve down (~2 s); one that has not exited within 10 s is
        # killed, and its cluster goes next anyway
        _stop(proc, signal.SIGINT, 10)
        _stop(killer, signal.SIGKILL, 10)
        log.close()
