"""Multi-host start-up: ``jax.distributed`` from the environment, and failing fast when a peer is lost.

jaxscale spans machines with JAX's own multi-controller runtime: every
process runs the same program over its local devices, ``jax.distributed``
connects them through a coordinator (process 0), and XLA's collectives move
the data. :func:`detect` reads who we are, in this order:

1. explicit settings: ``--coordinator/--num-processes/--process-id`` or the
   ``JAXSCALE_COORDINATOR``, ``JAXSCALE_NUM_PROCESSES``, ``JAXSCALE_PROCESS_ID``
   variables;
2. Kubernetes indexed Jobs / JobSets: the process id is
   ``JOB_COMPLETION_INDEX``; the coordinator is ``JAXSCALE_COORDINATOR`` or, in
   a JobSet, pod 0 of the first job behind the headless service
   (``<jobset>-<job>-0-0.<subdomain>:<port>``); the count is
   ``JAXSCALE_NUM_PROCESSES``;
3. SLURM (``SLURM_JOB_ID`` with more than one task) and Cloud TPU VMs
   (``TPU_WORKER_HOSTNAMES`` or ``CLOUD_TPU_TASK_ID``): JAX's own cluster
   detection fills in everything;
4. otherwise one process, and nothing is initialised.

On CPU the gloo collectives are selected, so several local processes form
one cluster (``launch/multiprocess.sh``, the multi-host tests).

Failure: a dead peer stops sending heartbeats, and after
``heartbeat_timeout_s`` the coordinator marks it lost. JAX's default then is to
kill every other process from a C++ thread with a message that need not name
the lost one; jaxscale turns on JAX's recoverability instead and watches the
coordinator's table of live processes from a thread of its own
(:func:`watch_peers`), so each survivor prints one line naming the lost
processes and exits non-zero. A collective that fails first (gloo sees the
closed connection at once) goes the same way through :func:`fail_fast`. A
process that cannot reach the coordinator fails after ``init_timeout_s``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping

from jaxscale.config import ConfigError

DEFAULT_PORT = 8476


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this process stands; ``method`` says how it was found."""

    method: str
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


def _int(value: str | None, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as e:
        raise ConfigError(f"{name}: expected an integer, got {value!r}") from e


def detect(
    env: Mapping[str, str] | None = None,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> Cluster:
    """Find the cluster this process belongs to (see the module docstring for the order)."""
    env = os.environ if env is None else env
    coordinator = coordinator or env.get("JAXSCALE_COORDINATOR") or None
    num_processes = num_processes if num_processes is not None else _int(
        env.get("JAXSCALE_NUM_PROCESSES"), "JAXSCALE_NUM_PROCESSES"
    )
    process_id = process_id if process_id is not None else _int(env.get("JAXSCALE_PROCESS_ID"), "JAXSCALE_PROCESS_ID")
    if "JOB_COMPLETION_INDEX" in env and process_id is None:
        process_id = _int(env["JOB_COMPLETION_INDEX"], "JOB_COMPLETION_INDEX")
        if coordinator is None and "JOBSET_NAME" in env:
            job = env.get("REPLICATED_JOB_NAME", "workers")
            subdomain = env.get("JAXSCALE_SUBDOMAIN", env["JOBSET_NAME"])
            coordinator = f"{env['JOBSET_NAME']}-{job}-0-0.{subdomain}:{DEFAULT_PORT}"
        method = "kubernetes"
    else:
        method = "explicit"
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if any(given):
        if not all(given):
            raise ConfigError(
                "distributed: give all of coordinator, num_processes and process_id "
                f"(got coordinator={coordinator}, num_processes={num_processes}, process_id={process_id})"
            )
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"distributed: process_id {process_id} is not in [0, {num_processes})")
        return Cluster(method, coordinator, num_processes, process_id)
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return Cluster("slurm")
    if "TPU_WORKER_HOSTNAMES" in env or "CLOUD_TPU_TASK_ID" in env:
        return Cluster("tpu")
    return Cluster("single")


def initialize(cluster: Cluster, init_timeout_s: int = 300, heartbeat_timeout_s: int = 100) -> None:
    """Start ``jax.distributed`` for a multi-process cluster (nothing for a single process)."""
    if cluster.method == "single":
        return
    import jax

    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)
    if cluster.coordinator and cluster.process_id:
        _wait_for_coordinator(cluster.coordinator, init_timeout_s)
    try:
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator,
            num_processes=cluster.num_processes,
            process_id=cluster.process_id,
            initialization_timeout=init_timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
    except Exception as e:
        where = cluster.coordinator or f"the {cluster.method} coordinator"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"could not join the cluster at {where} within {init_timeout_s} s: {first}") from e
    watch_peers()


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Wait until the coordinator accepts connections; JAX's client would abort the process instead."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2.0):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConfigError(f"could not reach the coordinator at {address} within {timeout_s} s: {e}") from e
            time.sleep(0.5)


def _lost() -> str | None:
    """The processes the coordinator no longer hears from, or None if all are alive."""
    import jax
    from jax._src import distributed as jax_distributed

    everyone = list(range(jax.process_count()))
    try:
        live = set(jax_distributed.global_state.client.get_live_nodes(everyone))
    except Exception:
        return "process 0 (the coordinator)"
    lost = [p for p in everyone if p not in live]
    return ", ".join(f"process {p}" for p in lost) if lost else None


_EXITING = threading.Lock()


def _exit_lost(lost: str, detail: str = "") -> None:
    """Print one line naming the lost processes and leave at once (the first caller wins)."""
    import jax

    if not _EXITING.acquire(blocking=False):
        time.sleep(60)
    tail = f": {detail}" if detail else ""
    print(f"jaxscale: error: process {jax.process_index()} lost {lost}{tail}", file=sys.stderr, flush=True)
    os._exit(1)


_WATCHING = threading.Event()


def watch_peers(interval_s: float = 2.0) -> threading.Thread:
    """A daemon thread that exits this process, naming them, once the coordinator reports peers lost."""

    def watch() -> None:
        while _WATCHING.is_set():
            time.sleep(interval_s)
            lost = _lost() if _WATCHING.is_set() else None
            if lost:
                _exit_lost(lost, "no heartbeat")

    _WATCHING.set()
    thread = threading.Thread(target=watch, name="jaxscale-peer-watch", daemon=True)
    thread.start()
    return thread


def finish(timeout_s: int = 300) -> None:
    """Leave the cluster together: a barrier, then the coordinator shuts down last.

    With recoverable tasks JAX's own shutdown barrier does not wait, so process 0
    would stop the coordination service under the others' feet.
    """
    import jax
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        return
    _WATCHING.clear()
    client.wait_at_barrier("jaxscale-finish", timeout_s * 1000)
    if jax.process_index() == 0:
        everyone = list(range(jax.process_count()))
        deadline = time.monotonic() + timeout_s
        while set(client.get_live_nodes(everyone)) - {0} and time.monotonic() < deadline:
            time.sleep(0.2)
    jax.distributed.shutdown()


@contextlib.contextmanager
def fail_fast(heartbeat_timeout_s: float) -> Iterator[None]:
    """In a multi-process run, exit non-zero with the lost processes' names when a collective fails."""
    import jax

    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if jax.process_count() == 1:
            raise
        deadline = time.monotonic() + heartbeat_timeout_s + 5
        lost = _lost()
        while lost is None and time.monotonic() < deadline:
            time.sleep(1.0)
            lost = _lost()
        _exit_lost(lost or "another process", str(e).strip().splitlines()[0])
