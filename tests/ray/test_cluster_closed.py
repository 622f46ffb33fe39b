"""The local Ray cluster is closed to the network, as a user of LLM(ep_size=2) gets it: while
the EP group serves, every listening TCP socket of the cluster's processes (the driver, GCS,
raylet, agents, workers, the head and its EP rank) is on loopback; and a driver that does not
hold the cluster's token cannot join it, while one that does can."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

import pytest

from epserve import LLM, SamplingParams
from epserve.cluster.bringup import cluster_listeners

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
REFUSED = "Authentication token is missing or incorrect"
_JOIN = "import sys, ray; ray.init(address=sys.argv[1], log_to_driver=False); print('JOINED')"


@pytest.fixture(scope="module")
def ep2(ray_cluster, qwen3_ckpt):
    llm = LLM(model=str(qwen3_ckpt), ep_size=2, dtype="float32")
    yield llm
    llm.close()


def test_every_listener_of_the_cluster_is_on_loopback(ep2):
    out = ep2.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3  # the EP group has really run
    listeners = cluster_listeners()
    # an actor's process is named ray::Class, or ray::Class.method while it runs one
    names = {name.partition(".")[0] for _, _, name in listeners}
    # the listing sees the cluster itself, not just this process
    assert {"gcs_server", "raylet", "ray::HeadActor", "ray::EpWorker"} <= names, names
    assert sorted(s for s in listeners if s[0] not in LOOPBACK) == []


def _joiner(address: str, home: str, **env: str) -> subprocess.Popen:
    """A driver joining ``address`` from this host with this process's environment (which
    init_ray gave the cluster's token and loopback setting) changed by ``env`` (a value of ""
    removes the variable); HOME elsewhere, so no ~/.ray/auth_token is used."""
    full = dict(os.environ, HOME=home, RAY_USAGE_STATS_ENABLED="0", **env)
    full = {k: v for k, v in full.items() if v}
    return subprocess.Popen([sys.executable, "-c", _JOIN, address], env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# A refused driver asks the GCS again once a second, 20 times by default, before ray.init
# gives up; every answer is the same refusal (logged each time), so 5 tries are enough to see
# that it never gets in.
GIVE_UP_SOONER = {"RAY_NUM_REDIS_GET_RETRIES": "5"}


def test_only_a_driver_with_the_token_can_join(ray_cluster, ep2, tmp_path):
    address = ray_cluster.get_runtime_context().gcs_address
    drivers = {
        "the token": _joiner(address, str(tmp_path)),
        "a wrong token": _joiner(address, str(tmp_path), RAY_AUTH_MODE="token",
                                 RAY_AUTH_TOKEN=secrets.token_hex(32), **GIVE_UP_SOONER),
        "no token, auth off": _joiner(address, str(tmp_path), RAY_AUTH_MODE="disabled",
                                      RAY_AUTH_TOKEN="", **GIVE_UP_SOONER),
    }
    results = {}
    deadline = time.monotonic() + 120  # they run at once: one bound for all three
    for what, proc in drivers.items():
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in drivers.values():
                p.kill()
                p.communicate()
            pytest.fail(f"a driver with {what} neither joined nor failed within 120 s")
        results[what] = (proc.returncode, out, err)
    rc, out, err = results.pop("the token")
    assert rc == 0 and "JOINED" in out, err[-2000:]
    for what, (rc, out, err) in results.items():
        assert rc != 0 and "JOINED" not in out, f"a driver with {what} joined the cluster"
        assert REFUSED in err, f"{what}: not refused for its token:\n{err[-2000:]}"
