"""A run that shrinks instead of stopping: fewer devices than the mesh asks for take a smaller ``data`` axis.

With ``distributed.elastic: true``, a run started on fewer devices than its mesh covers (a host of a multi-host
run lost, the launcher restarting the survivors) trains on a ``data`` axis shrunk to what is there, every other
axis (FSDP, TP, PP, EP, CP) as configured. The global batch stays the same, so the data stream's position is
kept exactly (the batch of step ``s`` is a function of ``(train.seed, s)``: no sample repeated or skipped); each
data replica takes more rows, in more microbatches (``train.microbatches`` grown so that no device holds more
rows of a microbatch than before). The checkpoint resumes onto the smaller mesh as onto any other
(:mod:`jaxscale.checkpoint.store`: each device reads its slice), the trainer's build checks the smaller mesh against
the rules before anything compiles, and a later start on all devices (the host back) re-expands it. The losses
then equal the full mesh's within the tolerance of a changed reduction order (tests/test_elastic.py).
With ``distributed.rejoin_every: K`` a shrunk run trains K steps, saves and exits with :data:`REJOIN`, for
``launch/multiprocess.sh --elastic`` to start all hosts again where it may (the launcher's policy is there).

Only ``data`` shrinks: a run whose other axes need the lost devices does not fit (one line, as before), and one
with ``mesh.dcn`` factors or an axis of -1 is left as it is (an axis of -1 fills what is there already).
"""

from __future__ import annotations

import dataclasses
import math
import sys

from jaxscale.config.mesh_size import requested_devices
from jaxscale.config.read import Config, ConfigError

REJOIN = 75  # the exit status of a shrunk run stopped after distributed.rejoin_every steps (EX_TEMPFAIL)


def fit(config: Config, device_count: int) -> tuple[Config, str | None]:
    """``config`` on ``device_count`` devices: with ``distributed.elastic`` and fewer devices than its mesh, the
    ``data`` axis shrunk and the microbatches grown; and a line saying so (None where nothing changed)."""
    wanted = requested_devices(config.mesh)
    if not config.distributed.elastic or wanted is None or wanted <= device_count or config.mesh.dcn is not None:
        return config, None
    mesh, train = config.mesh, config.train
    others = wanted // mesh.data
    data = device_count // others
    if data < 1:
        raise ConfigError(f"distributed.elastic: {device_count} devices cannot hold the mesh's other axes "
                          f"({others} devices without data={mesh.data}): only the data axis shrinks")
    split = mesh.fsdp  # the batch's other axis in the rules presets ([data, fsdp])
    rows = train.global_batch // (train.microbatches * mesh.data * split)  # a microbatch's rows per device
    micro = next((m for m in range(math.ceil(train.global_batch / (rows * data * split)), train.global_batch + 1)
                  if train.global_batch % m == 0 and (train.global_batch // m) % (data * split) == 0), None)
    if micro is None:
        raise ConfigError(f"distributed.elastic: train.global_batch={train.global_batch} does not split over "
                          f"data={data} (the {device_count} devices left)")
    shrunk = dataclasses.replace(
        config,
        mesh=dataclasses.replace(mesh, data=data),
        train=dataclasses.replace(train, microbatches=micro),
    )
    return shrunk, (f"distributed.elastic: {device_count} devices for a mesh of {wanted}: mesh.data {mesh.data} -> "
                    f"{data}, train.microbatches {train.microbatches} -> {micro} (the global batch unchanged)")


def apply(config: Config, device_count: int) -> Config:
    """:func:`fit`, its line printed as a warning by process 0."""
    import jax

    config, line = fit(config, device_count)
    if line and jax.process_index() == 0:
        print(f"jaxscale: warning: {line}", file=sys.stderr, flush=True)
    return config
