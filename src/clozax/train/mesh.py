"""Devices: the ``data`` mesh axis the global batch is split over, and where each array of the
train state lives on it (replicated, or sharded with ``train.fsdp``)."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def make_mesh(devices: int | None) -> Mesh:
    """The ``data`` axis over every device of the job (all processes'), each process's devices
    contiguous, so that each process holds one contiguous block of every global batch."""
    available = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    n = len(available) if devices is None else devices
    if n > len(available):
        raise ValueError(
            f"train.devices={n} but only {len(available)} device(s) are visible; lower it "
            "(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N)"
        )
    if jax.process_count() > 1 and n != len(available):
        raise ValueError(f"train.devices={n} would leave out devices of a {jax.process_count()}"
                         f"-process job ({len(available)} devices); leave train.devices unset")
    return Mesh(np.array(available[:n]), ("data",))


def process_rows(sharding, batch: int) -> slice:
    """The rows of a (batch, ...) array sharded by ``sharding`` that this process holds: one
    contiguous block (``make_mesh`` orders devices by process)."""
    index = sharding.addressable_devices_indices_map((batch,))
    starts = sorted(i[0].start or 0 for i in index.values())
    stops = sorted(batch if i[0].stop is None else i[0].stop for i in index.values())
    return slice(starts[0], stops[-1])


def global_batch(sharding, local: dict, batch: int) -> dict:
    """A global array per entry of ``local`` (this process's rows, ``process_rows``)."""
    return {k: jax.make_array_from_process_local_data(sharding, v, (batch, *v.shape[1:]))
            for k, v in local.items()}


def from_host(sharding, arrays):
    """Global arrays from host arrays every process holds whole (small evaluation batches)."""
    return [jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index])
            for a in arrays]


def place(tree, shardings):
    """``tree`` (every process holds the same values: the same seed drew them) on
    ``shardings``. One process: ``device_put``. Several: each process builds its own shards
    from its copy, as ``from_host`` does, since ``device_put`` onto devices of other processes
    first checks every leaf equal across processes (measured: 121 all-gathers, 5 s of a tiny
    2-process run's start)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def build(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(build, tree, shardings)


def state_shardings(state, mesh: Mesh, fsdp: bool):
    """Per-leaf ``NamedSharding`` of the train state over ``mesh``'s ``data`` axis.

    Replicated by default. With ``fsdp`` every array is split over the devices along its
    largest axis that the device count divides (the first such on ties); scalars and arrays
    with no such axis stay replicated. ``jit`` then gathers parameters where the step needs
    them whole and reduce-scatters the gradients, so each device keeps 1/n of the parameters
    and of AdamW's moments.
    """
    n = mesh.devices.size

    def sharding(x):
        divisible = [a for a in range(x.ndim) if x.shape[a] % n == 0]
        if not fsdp or n == 1 or not divisible:
            return NamedSharding(mesh, P())
        axis = max(divisible, key=lambda a: (x.shape[a], -a))
        return NamedSharding(mesh, P(*([None] * axis), "data"))

    return jax.tree.map(sharding, state)


def evaluation_placement(batch_size: int):
    """How a judge command spreads held-out batches over this process's devices: ``(put,
    replicate, batch)`` — ``put(arrays)`` splits a batch's rows over the ``data`` axis,
    ``replicate(params)`` copies parameters to every device, ``batch`` is ``batch_size`` raised
    to a multiple of the device count. One device: no placement at all."""
    n = jax.local_device_count()
    if n == 1:
        return None, lambda params: params, batch_size
    mesh = Mesh(np.array(jax.local_devices()), ("data",))
    rows, everywhere = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    return (lambda arrays: from_host(rows, arrays),
            lambda params: jax.device_put(params, everywhere), math.lcm(batch_size, n))
