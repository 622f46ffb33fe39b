"""Bring-up on Ray: join or start a cluster, and start the HeadActor (and its EP ranks).

This module owns the Ray cluster the process runs on. ``init_ray`` joins ``RAY_ADDRESS`` when it
is set: that cluster is the operator's, secured (or not) by them, and joined as it is. Otherwise
it starts a local cluster, and that cluster is closed to the network:

- every Ray process it starts (GCS, raylet, agents, workers, Serve's replicas through a
  worker setup hook) listens on loopback only; after start-up the listeners are checked, and
  any on another address shuts the cluster down with an error rather than leaving the host
  open;
- drivers must present a token: a fresh random one per local cluster, kept in this process's
  environment (inherited by the cluster's processes, written nowhere), unless the operator chose
  ``RAY_AUTH_MODE`` / ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH`` themselves;
- no dashboard.

Workers' output stays in Ray's log files (``log_to_driver`` off: Serve's controller, proxy and
replicas log every deployment change, endpoint update and request there), except, for a driver
that asks (``epserve serve``), the engine heads' own lines, printed as Ray would print them.

The head is a named actor (one per name), so every ingress replica reaches the same engine;
arguments cross as plain dicts.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import secrets
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # imported where used: every worker process imports this module (its hook)
    from epserve.cluster.engine_args import EngineArgs

log = logging.getLogger(__name__)

HEAD_NAME = "epserve-head"
NAMESPACE = "epserve"

# Ray's switch between "local only" and "multi-node" networking (see _bind_to_loopback)
_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_AUTH_MODE, _AUTH_TOKEN, _AUTH_TOKEN_PATH = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
# the token this module minted for the current local cluster: told apart from an operator's
_minted_token: str | None = None
# the actor name Ray gives a head's output (its class name: HeadActor has no __repr__)
_HEAD_ACTOR = "HeadActor"


def init_ray(num_cpus: int | None = None, engine_logs: bool = False) -> None:
    """Join ``RAY_ADDRESS``, or start a local cluster closed to the network (idempotent).

    ``engine_logs``: print what the engine heads this driver starts write (their log lines:
    each finished request, the periodic throughput / running / waiting / KV cache line,
    errors) on this process's stderr / stdout, as vLLM's server prints its engine's; no other
    worker's output. Raises RuntimeError (with the cluster shut down) when a process of the
    local cluster listens on a non-loopback address."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        # the operator's cluster: its networking and auth are theirs (the joining driver must
        # not pretend to be on 127.0.0.1 either, so nothing below applies)
        ray.init(address=os.environ["RAY_ADDRESS"], namespace=NAMESPACE,
                 log_to_driver=engine_logs)
        if engine_logs:
            _print_only_head_output()
        return
    _bind_to_loopback()
    _require_token()
    # listeners this process had before (an app embedding the LLM) are not the cluster's
    before = cluster_listeners()
    _start_local_cluster(num_cpus, engine_logs)
    open_ = [s for s in cluster_listeners() if s not in before and not _is_loopback(s[0])]
    if open_:
        ray.shutdown()
        shown = ", ".join(f"[{ip}]:{port} ({name})" if ":" in ip else f"{ip}:{port} ({name})"
                          for ip, port, name in sorted(open_))
        raise RuntimeError(f"the local Ray cluster listened beyond loopback ({shown}), so it "
                           f"was shut down: this Ray version binds differently from the one "
                           f"epserve/cluster/bringup.py was written for")


def _print_only_head_output() -> None:
    """Of the workers' output Ray forwards to this driver (``log_to_driver``: this job's
    workers, and Ray's own processes), print only the heads'. Ray's printer is swapped for a
    filter under its name, so ``ray.shutdown`` removes the filter as it would the printer.
    Each line as Ray prints it, ``(HeadActor pid=N) <line>``, on the stream the head wrote it
    to, without Ray's colours or de-duplication (one head: nothing to de-duplicate)."""
    import sys

    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    def head_only(data: dict[str, Any]) -> None:
        if data.get("actor_name") != _HEAD_ACTOR:
            return
        where = "" if data.get("ip") == data.get("localhost") else f", ip={data.get('ip')}"
        sink = sys.stderr if data.get("is_err") else sys.stdout
        for line in data.get("lines", ()):
            print(f"({_HEAD_ACTOR} pid={data.get('pid')}{where}) {line}", file=sink,
                  flush=True)

    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", head_only)


def _start_local_cluster(num_cpus: int | None, engine_logs: bool = False) -> None:
    """``ray.init`` of a local cluster whose every worker process runs ``loopback_grpc_hook``.

    The hook goes in the environment the cluster's processes inherit from this one (the variable
    Ray's ``runtime_env={"worker_process_setup_hook": ...}`` sets for a worker), not as the job's
    runtime_env: a worker of a job runtime_env is started afresh for every actor and task
    instead of taken from the pool Ray keeps started, ~0.8 s more per actor (the head, each EP
    rank, each Serve replica). Set while the cluster starts, then dropped: processes this one
    starts later (a subprocess's own cluster) get nothing of it."""
    import ray
    from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR as hook_env

    previous = os.environ.get(hook_env)
    os.environ[hook_env] = f"{__name__}.loopback_grpc_hook"
    try:
        ray.init(address="local", namespace=NAMESPACE, include_dashboard=False,
                 num_cpus=num_cpus, _node_ip_address="127.0.0.1",
                 log_to_driver=engine_logs)
        if engine_logs:
            _print_only_head_output()
    finally:
        if previous is None:
            os.environ.pop(hook_env, None)
        else:
            os.environ[hook_env] = previous


def _bind_to_loopback() -> None:
    """Make the local cluster's gRPC servers listen on 127.0.0.1 only.

    Ray binds them to loopback only when it believes multi-node clusters are off
    (``ray_constants.ENABLE_RAY_CLUSTER`` False): then the node IP resolves to 127.0.0.1 instead
    of the host's routable address, and the servers of a 127.0.0.1 node listen there. Ray reads
    that constant from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, at ``import ray``, which has
    usually happened already (the CLI, tests, user code): so set the module constant for this
    process, and the variable for the processes the cluster starts. Forced, not a default: an
    operator who wants a multi-node cluster starts one and passes ``RAY_ADDRESS``."""
    import ray._private.ray_constants as ray_constants

    os.environ[_CLUSTER_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def loopback_grpc_hook() -> None:
    """Worker setup hook of the local cluster (every worker process runs it at start).

    Ray Serve's replicas start an inter-deployment gRPC server on ``[::]:0`` whatever the node
    IP, with no option to bind it elsewhere (ray-project/ray#64544); Ray's other servers take
    the node IP. The replica opens that port with ``tls_utils.add_port_to_grpc_server``, which
    it imports when its class is loaded, after this hook: wrap it so that a wildcard address
    becomes 127.0.0.1 (the local node's address, so every caller still reaches it)."""
    from ray._common import tls_utils

    add_port = tls_utils.add_port_to_grpc_server
    if getattr(add_port, "epserve_loopback", False):
        return

    def on_loopback(server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        if host in ("[::]", "0.0.0.0", ""):
            address = f"127.0.0.1:{port}"
        return add_port(server, address)

    on_loopback.epserve_loopback = True  # type: ignore[attr-defined]
    tls_utils.add_port_to_grpc_server = on_loopback


def _require_token() -> None:
    """Token authentication for the local cluster: a fresh random token in ``RAY_AUTH_TOKEN``
    (so nothing lands in ~/.ray) unless the operator chose the mode or the token."""
    global _minted_token
    from ray._raylet import AuthenticationTokenLoader, Config

    mode = os.environ.get(_AUTH_MODE, "").lower()
    ours = _minted_token is not None and os.environ.get(_AUTH_TOKEN) == _minted_token
    # a bare RAY_AUTH_MODE=token means Ray's own token file (~/.ray/auth_token): theirs too
    theirs = not ours and bool(mode == "token" or os.environ.get(_AUTH_TOKEN)
                               or os.environ.get(_AUTH_TOKEN_PATH))
    if mode and mode != "token":
        log.warning("%s=%s: the local Ray cluster accepts any driver that reaches 127.0.0.1 "
                    "(any local user or process); unset it for token authentication",
                    _AUTH_MODE, mode)
    elif theirs:
        os.environ[_AUTH_MODE] = "token"
    else:
        _minted_token = secrets.token_hex(32)
        os.environ[_AUTH_TOKEN] = _minted_token
        os.environ[_AUTH_MODE] = "token"
    # Ray cached RAY_AUTH_MODE and the token at import: re-read both from the environment
    # (config first, then the token cache, as Ray's own auth setup does)
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def cluster_listeners(pid: int | None = None) -> set[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of process ``pid`` (this
    one by default) and its descendants: a local cluster's GCS, raylet, workers and agents
    all descend from the driver that started it."""
    import ray  # noqa: F401  (puts Ray's vendored psutil on the path)
    import psutil

    root = psutil.Process(pid)
    names = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            names[proc.pid] = proc.name()
        except psutil.Error:  # gone meanwhile
            pass
    return {(c.laddr.ip, c.laddr.port, names[c.pid])
            for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in names}


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1 (a dual-stack socket)
    return (mapped or addr).is_loopback


def placement_device(device: str) -> str:
    """Where the ranks must be placed: ``auto`` means GPUs when the cluster has any (the driver
    itself may run on a CPU-only head node)."""
    import ray

    if device.startswith("cuda"):
        return "cuda"
    if device == "cpu":
        return "cpu"
    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def start_head(args: EngineArgs, name: str = HEAD_NAME, timeout_s: float = 600.0,
               detached: bool = True) -> Any:
    """The named HeadActor for ``args`` (created when absent) once its model is loaded
    (``launch_head``, then its wait)."""
    return launch_head(args, name, timeout_s, detached)()


def launch_head(args: EngineArgs, name: str = HEAD_NAME, timeout_s: float = 600.0,
                detached: bool = True) -> Callable[[], Any]:
    """The named HeadActor for ``args``, created (when absent) now; the returned call waits
    for its model to load and returns it, or raises ``ValueError`` with why it died loading.

    With ``ep_size`` N > 1 a placement group of N bundles (``args.placement_strategy``:
    STRICT_PACK on one node by default, or SPREAD) holds the head in bundle 0 and EP ranks
    1..N-1 in the others."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from epserve.cluster.engine_args import check_model_path
    from epserve.cluster.ep_group import bundle
    from epserve.cluster.head_actor import HeadActor

    args = args.resolved()
    strategy = args.placement_strategy
    # refused here, before Ray or any actor starts, with the loader's own message
    check_model_path(args.model)
    if args.ep_size > 1:
        from epserve.models.config import ModelConfig
        from epserve.models.parallel import ParallelInfo

        experts = ModelConfig.from_pretrained(args.model).num_experts
        ParallelInfo(0, args.ep_size).local_expert_range(experts)
    init_ray()
    opts: dict[str, Any] = dict(name=name, namespace=NAMESPACE, get_if_exists=True,
                                num_cpus=0, max_concurrency=10_000)
    if detached:
        opts["lifetime"] = "detached"
    pg = None
    device_type = placement_device(args.device)
    if args.ep_size == 1 and device_type == "cuda":
        opts["num_gpus"] = 1
    if args.ep_size > 1:
        pg = placement_group([bundle(device_type)] * args.ep_size, strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except Exception:
            raise ValueError(f"ep_size={args.ep_size}: the cluster cannot place "
                             f"{args.ep_size} ranks ({bundle(device_type)} each, "
                             f"{strategy})") from None
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0)
        if device_type == "cuda":
            opts["num_gpus"] = 1
    head = ray.remote(HeadActor).options(**opts).remote(args.to_dict(), pg)
    return functools.partial(_loaded, head, pg, args.model, timeout_s)


def _loaded(head: Any, pg: Any, model: str, timeout_s: float) -> Any:
    import ray
    from ray.util.placement_group import remove_placement_group

    try:
        ray.get(head.ready.remote(), timeout=timeout_s)
    except ray.exceptions.RayActorError as exc:  # it died loading (e.g. a corrupt checkpoint)
        if pg is not None:
            remove_placement_group(pg)
        said = [line for line in str(exc).splitlines() if line.strip()]  # its traceback's end
        raise ValueError(f"the engine could not start on {model}: "
                         f"{said[-1] if said else type(exc).__name__}") from None
    return head


def stop_head(name: str = HEAD_NAME) -> None:
    """Shut the named head down (and with it its EP ranks), if it exists."""
    import ray

    try:
        head = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return
    try:
        ray.get(head.shutdown.remote(), timeout=30)
    except Exception as exc:  # a dead or stuck head is killed all the same
        log.warning("head shutdown: %s", exc)
    ray.kill(head, no_restart=True)
