"""Devices: the ``data`` mesh axis the global batch is split over, and where each array of the
train state lives on it (replicated, or sharded with ``train.fsdp``)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def make_mesh(devices: int | None) -> Mesh:
    available = jax.local_devices()
    n = len(available) if devices is None else devices
    if n > len(available):
        raise ValueError(
            f"train.devices={n} but only {len(available)} device(s) are visible; lower it "
            "(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N)"
        )
    return Mesh(np.array(available[:n]), ("data",))


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
