"""Meshes, logical-axis rules, and the target / drafter device slices.

Sharding is data (MaxText style): parameters and activations are annotated with *logical* axis
names; a rules table maps each logical name to mesh axes.  ``shard`` is a no-op unless a mesh
is active (``use_mesh``), so the same model code runs on one CPU and on a pod.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from d3d_jax.config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("act_embed", None),
    ("vocab", "tensor"),
    ("act_vocab", "tensor"),
    ("heads", "tensor"),
    ("act_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("act_mlp", "tensor"),
    ("norm", None),
    ("layers", None),
    ("cache_length", None),
)

# Parameter logical axes, keyed by (module name, leaf name) at the end of a parameter path.
PARAM_AXES: dict[tuple[str, str], tuple[str | None, ...]] = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("q_proj", "kernel"): ("embed", "heads", "head_dim"),
    ("k_proj", "kernel"): ("embed", "kv_heads", "head_dim"),
    ("v_proj", "kernel"): ("embed", "kv_heads", "head_dim"),
    ("o_proj", "kernel"): ("heads", "head_dim", "embed"),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
}

_state = {"mesh": None, "rules": dict(DEFAULT_RULES)}


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``data × fsdp × tensor`` mesh over ``devices`` (default: all devices)."""
    devices = list(jax.devices() if devices is None else devices)
    cfg.validate()
    sizes = cfg.axis_sizes(len(devices))
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes), MESH_AXES)


def split_devices(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None
                  ) -> tuple[list[jax.Device], list[jax.Device]]:
    """Disjoint target and drafter device lists (spec §5).  0/0 means both share all devices."""
    devices = list(jax.devices() if devices is None else devices)
    t, d = cfg.target_devices, cfg.drafter_devices
    if t == 0 and d == 0:
        return devices, devices
    if t <= 0 or d <= 0:
        raise ConfigError("mesh.target_devices/drafter_devices: set both (> 0) or neither")
    if t + d > len(devices):
        raise ConfigError(f"mesh.target_devices + mesh.drafter_devices = {t + d} but only "
                          f"{len(devices)} devices exist")
    return devices[:t], devices[t:t + d]


def check_disjoint(a: Sequence[jax.Device], b: Sequence[jax.Device]) -> None:
    overlap = {d.id for d in a} & {d.id for d in b}
    if overlap and not (len(a) == len(b) and set(d.id for d in a) == set(d.id for d in b)):
        raise ConfigError(f"mesh: target and drafter slices overlap on devices {sorted(overlap)}")


def rules_dict(rules: Sequence[tuple[str, Any]] | None = None) -> dict[str, Any]:
    out = dict(DEFAULT_RULES)
    if rules:
        out.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in rules})
    return out


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None, rules: Sequence[tuple[str, Any]] | None = None) -> Iterator[Mesh | None]:
    """Make ``mesh`` (and the logical rules) active for ``shard`` inside the block.

    ``shard`` acts at trace time and jit's cache does not know about this context: a jitted
    function first traced outside the block keeps its unconstrained trace inside it.  Trace
    (call for the first time) inside the block, or use a separate jitted function per mesh.
    """
    prev = dict(_state)
    _state["mesh"] = mesh
    _state["rules"] = rules_dict(rules)
    try:
        yield mesh
    finally:
        _state.update(prev)


def active_mesh() -> Mesh | None:
    return _state["mesh"]


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None, rules: dict[str, Any] | None = None) -> P:
    """PartitionSpec for logical ``axes``; a dim that a mesh axis does not divide stays replicated."""
    mesh = mesh if mesh is not None else _state["mesh"]
    rules = rules if rules is not None else _state["rules"]
    used: set[str] = set()
    spec = []
    for i, name in enumerate(axes):
        target = rules.get(name) if name is not None else None
        if target is None:
            spec.append(None)
            continue
        names = (target,) if isinstance(target, str) else tuple(target)
        names = tuple(n for n in names if n not in used and (mesh is None or mesh.shape.get(n, 1) > 1))
        if mesh is not None and shape is not None:
            size = int(np.prod([mesh.shape[n] for n in names])) if names else 1
            if size > 1 and shape[i] % size:
                names = ()
        used.update(names)
        spec.append(names[0] if len(names) == 1 else (names if names else None))
    return P(*spec)


def shard(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Constrain an activation to its logical sharding; a no-op without an active mesh."""
    mesh = _state["mesh"]
    if mesh is None:
        return x
    spec = logical_to_spec(axes, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def param_axes(path: Sequence[Any], ndim: int) -> tuple[str | None, ...]:
    """Logical axes of a parameter from its path (norm scales and unknown leaves: replicated)."""
    names = [str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path]
    names = [n for n in names if not re.fullmatch(r"\d+|value|raw_value", n)]
    if len(names) >= 2 and (names[-2], names[-1]) in PARAM_AXES:
        axes = PARAM_AXES[(names[-2], names[-1])]
        if len(axes) == ndim:
            return axes
    return (None,) * ndim


def param_sharding(path: Sequence[Any], shape: Sequence[int], mesh: Mesh,
                   rules: dict[str, Any] | None = None) -> NamedSharding:
    axes = param_axes(path, len(shape))
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules or _state["rules"]))


def shard_model(model: Any, mesh: Mesh | None, rules: Sequence[tuple[str, Any]] | None = None) -> Any:
    """Place every parameter of an NNX model on ``mesh`` following the logical rules (in place)."""
    from flax import nnx

    if mesh is None:
        return model
    rd = rules_dict(rules)
    state = nnx.state(model)
    shardings = jax.tree_util.tree_map_with_path(
        lambda p, x: param_sharding(p, x.shape, mesh, rd), state)
    nnx.update(model, jax.device_put(state, shardings))
    return model


def state_shardings(state: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]] | None = None) -> Any:
    """NamedShardings for a model (or optimiser) state pytree, by parameter path."""
    rd = rules_dict(rules)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: param_sharding(p, getattr(x, "shape", ()), mesh, rd), state)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Shard the leading (batch) dim over data×fsdp."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), None, mesh))
