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

Failure: every survivor prints one line, ``jaxscale: error: process I lost
process J: ...``, and exits 1, within seconds whoever died:

- each process listens on a port of its own (published in the coordinator's
  key-value store at start-up, read by all); a dead process's port refuses
  connections at once, a dead host's times out, so :func:`probe` names the lost
  processes in a second or two;
- a collective that fails (gloo sees the closed connection at once) is caught by
  :func:`fail_fast`, which probes and exits;
- losing the coordinator makes JAX abort the process from a C++ thread with a
  fatal log (its client has no Python hook for it: the callback it accepts
  cannot be called with the status), so the process's stderr goes through a
  small filter process (:func:`_filter_stderr`) that passes everything on but
  JAX's coordination-service logs, and puts the one line in place of the fatal one;
- a peer that hangs but keeps its port open is named when the coordinator stops
  hearing its heartbeats (``heartbeat_timeout_s``): jaxscale turns on JAX's
  recoverability (otherwise JAX kills every other process from a C++ thread) and
  watches the table of live processes from a thread of its own (:func:`watch_peers`).

A process that cannot reach the coordinator fails after ``init_timeout_s``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping

from jaxscale.config.read import ConfigError

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
    _filter_stderr(cluster.process_id)
    try:
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator,
            num_processes=cluster.num_processes,
            process_id=cluster.process_id,
            initialization_timeout=init_timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
        _publish_port(init_timeout_s)
    except Exception as e:
        where = cluster.coordinator or f"the {cluster.method} coordinator"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"could not join the cluster at {where} within {init_timeout_s} s: {first}") from e
    watch_peers()


_PEERS: dict[int, tuple[str, int]] = {}
# JAX's logs of a lost coordination service: the fatal one, the errors before it, their continuation lines
# (jax 0.12 continues a status over lines: ":UNAVAILABLE:...", a source location trace, a hint, a blank line).
_FATAL = re.compile(rb"^F\d{4} .*Terminating process because the JAX distributed service detected fatal errors")
_NOISE = re.compile(
    rb"^([EW]\d{4} .*(coordination_service_agent|preemption_sync_manager|coordination_service)\.cc:\d+\]"
    rb"|Additional GRPC error information|:[A-Z_]+:|\*\*\* Check failure stack trace|\s+@ "
    rb"|=== Source Location Trace: ===|\S+\.(cc|h):\d+\s*$|\. This is only expected if one of the tasks is unhealthy)"
)


def _filter_stderr(process_id: int | None) -> None:
    """Send this process's stderr (fd 2) through a forked filter (before jax starts: no threads yet)."""
    read, write = os.pipe()
    if os.fork() == 0:
        os.close(write)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the trainer: keep passing its last words
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _filter(read, 2, process_id)
        os._exit(0)
    os.close(read)
    os.dup2(write, 2)
    os.close(write)


def _filter(read: int, out: int, process_id: int | None) -> None:
    """Copy ``read`` to ``out`` until end of file, dropping JAX's coordination-service logs.

    In place of JAX's fatal log (the coordinator is lost) write ``jaxscale: error: process I lost
    process 0 ...``; of such lines (the trainer's own, from a failed collective, may come too) only
    the first goes on. Text without a line end (a progress bar) goes on at once unless its first
    character may begin one of those logs or a lost-peer line: a line that reaches the pipe in two
    reads is judged whole (passed on in pieces, the trainer's line once slipped past the one-line rule,
    and a survivor wrote two)."""
    pending, said, dropped = b"", False, False
    while chunk := os.read(read, 1 << 16):
        pending += chunk
        while (end := min((i for i in (pending.find(b"\n"), pending.find(b"\r")) if i >= 0), default=-1)) >= 0:
            line, pending = pending[: end + 1], pending[end + 1 :]
            noise = _NOISE.match(line) or (dropped and line == b"\n")  # blank lines after a dropped log too
            dropped = bool(noise or _FATAL.match(line))
            if line.startswith(b"jaxscale: error: process "):  # a lost peer: one line is enough
                if not said:
                    os.write(out, line)
                said = True
            elif _FATAL.match(line):
                if not said:
                    status = line.partition(b"absl::Status: ")[2].split(b". ")[0].strip().decode(errors="replace")
                    me = "this process" if process_id is None else f"process {process_id}"
                    os.write(out, f"jaxscale: error: {me} lost process 0 (the coordinator): {status}\n".encode())
                said = True
            elif not noise:
                os.write(out, line)
        if pending[:1] not in b"FEW \t*:Aje=.":
            os.write(out, pending)
            pending = b""
    if pending:
        os.write(out, pending)


def _publish_port(timeout_s: int) -> None:
    """Listen on a free port, publish ``host:port`` in the coordinator's key-value store, read the others'."""
    import jax
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    host = _address_towards(state.coordinator_address)
    server = socket.create_server(("", 0))
    threading.Thread(target=_accept, args=(server,), name="jaxscale-alive", daemon=True).start()
    me = jax.process_index()
    state.client.key_value_set(f"jaxscale/alive/{me}", f"{host}:{server.getsockname()[1]}")
    for peer in range(jax.process_count()):
        if peer != me:
            address = state.client.blocking_key_value_get(f"jaxscale/alive/{peer}", timeout_s * 1000)
            peer_host, _, port = address.rpartition(":")
            _PEERS[peer] = (peer_host, int(port))


def _address_towards(coordinator: str) -> str:
    """This host's address on the route to the coordinator (what the peers can reach)."""
    host = coordinator.rpartition(":")[0].strip("[]")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 1))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


def _accept(server: socket.socket) -> None:
    while True:
        conn, _ = server.accept()
        conn.close()


def _alive(address: tuple[str, int], timeout_s: float) -> bool:
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return True
    except OSError:
        return False


def probe(peers: Iterable[int] | None = None, timeout_s: float = 2.0) -> list[int]:
    """The processes among ``peers`` (default: all others) whose port no longer answers."""
    peers = sorted(_PEERS if peers is None else set(peers) & set(_PEERS))
    if not peers:
        return []
    with concurrent.futures.ThreadPoolExecutor(min(len(peers), 32)) as pool:
        alive = list(pool.map(lambda p: _alive(_PEERS[p], timeout_s), peers))
    return [p for p, ok in zip(peers, alive, strict=True) if not ok]


def _names(processes: list[int]) -> str:
    return ", ".join(f"process {p}" + (" (the coordinator)" if p == 0 else "") for p in processes)


def _neighbours() -> list[int]:
    """The peers a watching process probes: the next one in the ring and the coordinator (so each
    process is probed by one or two others, whatever the size of the job)."""
    import jax

    me, count = jax.process_index(), jax.process_count()
    return sorted({(me + 1) % count, 0} - {me})


LOST_KEY = "jaxscale/lost"


def _tell_others(lost: str) -> None:
    """Leave the names of the lost processes in the coordinator's key-value store for the others' watch."""
    from jax._src import distributed as jax_distributed

    with contextlib.suppress(Exception):
        jax_distributed.global_state.client.key_value_set(LOST_KEY, lost, allow_overwrite=True)


def _told() -> str | None:
    from jax._src import distributed as jax_distributed

    try:
        return jax_distributed.global_state.client.key_value_try_get(LOST_KEY) or None
    except Exception:
        return None


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

    if not _EXITING.acquire(blocking=False):  # another thread is printing and leaving: never a second line
        threading.Event().wait()
    tail = f": {detail}" if detail else ""
    print(f"jaxscale: error: process {jax.process_index()} lost {lost}{tail}", file=sys.stderr, flush=True)
    os._exit(1)


_WATCHING = threading.Event()


def watch_peers(interval_s: float = 2.0) -> threading.Thread:
    """A daemon thread that exits this process, naming them, once peers are lost: its neighbours' ports
    closed (:func:`_neighbours`; it then tells the others through the coordinator), another process
    told so, or the coordinator no longer hears their heartbeats."""

    def watch() -> None:
        while _WATCHING.is_set():
            time.sleep(interval_s)
            if not _WATCHING.is_set():
                break
            lost = probe(_neighbours())
            if lost:
                _tell_others(_names(lost))
                _exit_lost(_names(lost), "its port is closed")
            told = _told()
            if told:
                _exit_lost(told, "seen by another process")
            heartbeat = _lost()
            if heartbeat:
                _exit_lost(heartbeat, "no heartbeat")

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
        lost = _names(probe()) or _told()
        while not lost and time.monotonic() < deadline:
            time.sleep(1.0)
            lost = _names(probe()) or _told() or _lost()
        _exit_lost(lost or "another process", str(e).strip().splitlines()[0])
