"""The server's Ray cluster is closed to the network: while it answers over HTTP, every
listening TCP socket of the cluster's processes (the driver, GCS, raylet, the Serve controller,
proxy and replica, the engine's head) is on loopback, the HTTP port included."""

from __future__ import annotations

from urllib.parse import urlparse

import requests

from epserve.cluster.bringup import cluster_listeners

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def test_every_listener_of_the_serving_cluster_is_on_loopback(server):
    r = requests.post(server.v1 + "/completions", headers=server.auth, timeout=120, json={
        "model": server.model, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text  # the whole path (proxy, replica, head) has run
    listeners = cluster_listeners()
    # an actor's process is named ray::Class, or ray::Class.method while it runs one
    names = {name.partition(".")[0] for _, _, name in listeners}
    # the listing sees the Serve and engine processes, not just this one
    assert {"gcs_server", "raylet", "ray::ServeController", "ray::ProxyActor",
            "ray::HeadActor"} <= names, names
    assert any(n.startswith("ray::ServeReplica") for n in names), names
    port = urlparse(server.base).port
    assert any(p == port and n.startswith("ray::ProxyActor") for _, p, n in listeners), \
        listeners
    assert sorted(s for s in listeners if s[0] not in LOOPBACK) == []
