"""Orbax's emergency checkpoint manager (a node-local tier beside the persistent one) on gloo CPU processes, as JSON.

    python benchmarks/emergency_tier.py [WORK_DIR] > emergency.json

Two processes of 2 CPU devices, a mesh (data=2 across the processes, fsdp=2 within each), ``data`` orbax's replica
axis: the primary replica (process 0) writes the persistent tier (every 4 steps), the other one its own local
directory (every step: a node's local disk, which no other process reads). Steps 1..5 are saved, the newest
restored (step 5: from process 1's local tier, broadcast to process 0), then process 1's local directory is wiped
(its host replaced) and the newest restored again (step 4: the persistent tier). Each process prints one line: the
steps restored and whether their values are the saved ones, and the seconds each save blocked.

What it takes on orbax 0.12.8 / jax 0.10.2 beside the manager itself: the local directories created by the caller,
``multihost.initialize_runtime_to_distributed_ids()`` and ``initialize_distributed_to_device_ids()`` after
``jax.distributed.initialize`` (else the save fails: "Please call initialize_distributed_to_device_ids()"), and
absl's flags marked parsed (else the local restore fails reading
``--experimental_use_distributed_id_for_mesh_consistency``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS, PERSISTENT_EVERY = 5, 4


def process(pid: int, work: Path, port: int) -> dict:
    """One of the two processes: save, restore, lose the local tier of process 1, restore."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid)
    import jax.numpy as jnp
    import numpy as np
    from absl import flags
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from orbax.checkpoint import args as ocp_args
    from orbax.checkpoint._src.multihost import multihost
    from orbax.checkpoint.experimental.emergency import checkpoint_manager as em

    flags.FLAGS.mark_as_parsed()
    multihost.initialize_runtime_to_distributed_ids()
    multihost.initialize_distributed_to_device_ids()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "fsdp"))
    state = {"w": jax.device_put(jnp.zeros((4, 8)), NamedSharding(mesh, PartitionSpec(None, "fsdp")))}
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    options = em.CheckpointManagerOptions(local=em.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2),
                                          persistent=em.PersistentCheckpointOptions(PERSISTENT_EVERY))
    local = work / f"local{pid}"
    local.mkdir(parents=True, exist_ok=True)

    def manager() -> em.CheckpointManager:
        return em.CheckpointManager(local, work / "persistent", mesh, abstract, options=options)

    def restored() -> tuple[int, bool]:
        m = manager()
        step = m.latest_step()
        w = m.restore(step).state["w"]
        m.close()
        return int(step), bool(jnp.all(w == step))  # step k saved w = k everywhere

    m, blocked = manager(), []
    for step in range(1, STEPS + 1):
        state = {"w": state["w"] + 1}
        start = time.perf_counter()
        m.save(step, args=ocp_args.Composite(state=ocp_args.PyTreeSave(state)))
        blocked.append(round(time.perf_counter() - start, 3))
        m.wait_until_finished()
    m.close()
    first = restored()
    if pid == 1:
        shutil.rmtree(local)
        local.mkdir()
    multihost_utils.sync_global_devices("local tier of process 1 lost")
    return {"process": pid, "restored": first, "after_local_lost": restored(), "save_blocked_s": blocked}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--process":
        print(json.dumps(process(int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))), flush=True)
        os._exit(0)  # the coordination service's shutdown barrier is no part of the question
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    port = 8400 + os.getpid() % 1000
    procs = [subprocess.Popen([sys.executable, __file__, "--process", str(pid), str(work), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for pid in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        lines = [line for line in out.splitlines() if line.startswith("{")]  # not gloo's lines
        print(lines[-1] if lines else json.dumps({"exit": p.returncode}), flush=True)


if __name__ == "__main__":
    main()
