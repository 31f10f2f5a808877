"""Device slices for the target and the drafter (spec §5: disjoint slices of the device mesh)."""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from d3d_jax.config import ConfigError, MeshConfig
from d3d_jax.parallel.sharding import check_disjoint, make_mesh, split_devices, state_shardings


def resolve_slices(target_devices=None, drafter_devices=None, devices=None
                   ) -> tuple[list[jax.Device], list[jax.Device]]:
    """Target and drafter device lists from counts (as ``MeshConfig``) or explicit device lists.

    Neither given: both share the default device.  Lists must be disjoint or identical (shared).
    """
    devices = list(jax.devices() if devices is None else devices)
    if target_devices is None and drafter_devices is None:
        return devices[:1], devices[:1]
    if isinstance(target_devices, (int, np.integer)) or isinstance(drafter_devices, (int, np.integer)):
        if not (isinstance(target_devices, (int, np.integer))
                and isinstance(drafter_devices, (int, np.integer))):
            raise ConfigError("mesh.target_devices/drafter_devices: give both as counts or both as "
                              "device lists")
        cfg = MeshConfig(target_devices=int(target_devices), drafter_devices=int(drafter_devices))
        cfg.validate()
        return split_devices(cfg, devices)
    t, d = list(target_devices or []), list(drafter_devices or [])
    if not t or not d:
        raise ConfigError("mesh.target_devices/drafter_devices: give both device lists (non-empty)")
    known = {x.id for x in devices}
    for name, lst in (("target_devices", t), ("drafter_devices", d)):
        missing = [x for x in lst if getattr(x, "id", None) not in known]
        if missing:
            raise ConfigError(f"mesh.{name}: {missing[0]!r} is not one of the {len(devices)} devices")
    check_disjoint(t, d)
    return t, d


def placer(devices: list[jax.Device]) -> tuple[Callable, Callable]:
    """``(place_params, place)``: parameters by the logical rules on the slice, the rest replicated."""
    if len(devices) == 1:
        dev = devices[0]
        return (lambda tree: jax.device_put(tree, dev)), (lambda tree: jax.device_put(tree, dev))
    mesh: Mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=-1), devices)
    rep = NamedSharding(mesh, P())
    return ((lambda tree: jax.device_put(tree, state_shardings(tree, mesh))),
            (lambda tree: jax.device_put(tree, rep)))
