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


class RowPlacement:
    """Which device row holds which slot's request: live rows stay packed at the low rows, in
    class order (class 0, then class 1: auto's speculative and plain groups), so a round runs over
    a window of the live rows only.  Every change is a list of row swaps the device replays in
    order (host bookkeeping here, the swaps in :func:`~d3d_jax.decoding.window.apply_swaps`)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.row_of: dict[int, int] = {}  # slot -> row
        self.slot_at: list[int | None] = [None] * num_slots  # row -> slot
        self.cls: dict[int, int] = {}  # slot -> class (0 or 1)
        self.boundary = 0  # rows [0, boundary) are class 0

    @property
    def size(self) -> int:
        return len(self.row_of)

    def _swap(self, a: int, b: int, ops: list) -> None:
        if a == b:
            return
        sa, sb = self.slot_at[a], self.slot_at[b]
        self.slot_at[a], self.slot_at[b] = sb, sa
        for slot, row in ((sa, b), (sb, a)):
            if slot is not None:
                self.row_of[slot] = row
        ops.append((a, b))

    def place(self, slot: int, cls: int = 0) -> list[tuple[int, int]]:
        """``slot`` takes the next free row (moved into its class's range); returns the swaps."""
        ops: list = []
        row = self.size
        self.slot_at[row], self.row_of[slot], self.cls[slot] = slot, row, 1
        if cls == 0:
            self.set_class(slot, 0, ops)
        return ops

    def remove(self, slot: int) -> list[tuple[int, int]]:
        """``slot`` leaves; the rows above close the gap (its row ends up past the live ones)."""
        ops: list = []
        if self.cls[slot] == 0:
            self.set_class(slot, 1, ops)
        self._swap(self.row_of[slot], self.size - 1, ops)
        self.slot_at[self.row_of.pop(slot)] = None
        del self.cls[slot]
        return ops

    def set_class(self, slot: int, cls: int, ops: list | None = None) -> list[tuple[int, int]]:
        ops = [] if ops is None else ops
        if self.cls[slot] != cls:
            if cls == 0:  # to the first class-1 row, which becomes class 0
                self._swap(self.row_of[slot], self.boundary, ops)
                self.boundary += 1
            else:  # to the last class-0 row, which becomes class 1
                self.boundary -= 1
                self._swap(self.row_of[slot], self.boundary, ops)
            self.cls[slot] = cls
        return ops

    def groups(self) -> list[tuple[int, int, int]]:
        """``(lo, hi, class)`` of each non-empty class range of rows."""
        spans = [(0, self.boundary, 0), (self.boundary, self.size, 1)]
        return [g for g in spans if g[1] > g[0]]
