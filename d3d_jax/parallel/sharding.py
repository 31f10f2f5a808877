"""Meshes, logical-axis rules, and the target / drafter device slices.

Sharding is data (MaxText / tunix style).  Every parameter declares its *logical* axes where the
model makes it (``nnx.Param(..., out_sharding=("embed", "mlp"))`` in ``model/qwen3.py``), and
activations name theirs in ``shard(x, axes)``; a rules table maps each logical name to mesh axes.
:func:`logical_axes` is the one reader of the parameters' annotations: training, inference
placement and the memory plan all ask it, and a parameter without an annotation is an error.

The mesh is JAX's own context (``jax.set_mesh``, entered by :func:`use_mesh`), so jit's cache
sees it: a function traced without a mesh is traced again under one.  Rules other than
``DEFAULT_RULES`` travel in flax's logical-axis-rules context.  ``shard`` is a no-op without a
mesh, so the same model code runs on one CPU and on a pod.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from d3d_jax.config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("saved_length", "tensor"),  # the layer inputs a scanned layer stack keeps for its backward
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

AnyMesh = Mesh | AbstractMesh
Axes = tuple[str | None, ...]


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``data × fsdp × tensor`` mesh over ``devices`` (default: all devices)."""
    devices = list(jax.devices() if devices is None else devices)
    cfg.validate()
    sizes = cfg.axis_sizes(len(devices))
    # Auto axes: XLA propagates shardings from the constraints (explicit axes would put shardings
    # into the types, and JAX's default for new meshes has changed between versions).
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))


def check_disjoint(a: Sequence[jax.Device], b: Sequence[jax.Device]) -> None:
    overlap = {d.id for d in a} & {d.id for d in b}
    if overlap and not (len(a) == len(b) and set(d.id for d in a) == set(d.id for d in b)):
        raise ConfigError(f"mesh: target and drafter slices overlap on devices {sorted(overlap)}")


def rules_dict(rules: Sequence[tuple[str, Any]] | None = None) -> dict[str, Any]:
    """``DEFAULT_RULES`` overridden by ``rules`` (``(logical, mesh axes)`` pairs, as ``mesh.rules``)."""
    out = dict(DEFAULT_RULES)
    if rules:
        out.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in rules})
    return out


def current_rules() -> dict[str, Any]:
    """The rules in force: the defaults overridden by flax's logical-axis-rules context."""
    return rules_dict(flax_spmd.get_logical_axis_rules())


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None, rules: Sequence[tuple[str, Any]] | None = None) -> Iterator[Mesh | None]:
    """``jax.set_mesh(mesh)`` plus the logical ``rules`` for the block; ``None``: no mesh.

    The mesh is part of what jit traces under, so a function first traced outside the block is
    traced again inside it.  The rules are not: keep one set of rules per mesh.
    """
    if mesh is None:
        yield None
        return
    with jax.set_mesh(mesh), flax_spmd.logical_axis_rules(tuple(rules_dict(rules).items())):
        yield mesh


def active_mesh() -> AbstractMesh | None:
    """The mesh of JAX's context (also inside jit, as an abstract mesh), or ``None``."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int] | None = None,
                    mesh: AnyMesh | None = None, rules: Mapping[str, Any] | None = None) -> P:
    """PartitionSpec for logical ``axes``; a dim that a mesh axis does not divide stays replicated.

    ``mesh`` / ``rules`` default to the active ones.  A logical name without a rule is an error
    (a misspelt name would otherwise leave its dimension replicated).
    """
    mesh = mesh if mesh is not None else active_mesh()
    rules = rules if rules is not None else current_rules()
    used: set[str] = set()
    spec = []
    for i, name in enumerate(axes):
        if name is not None and name not in rules:
            raise ValueError(f"logical axis {name!r} has no sharding rule (known: {', '.join(sorted(rules))})")
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
    mesh = active_mesh()
    if mesh is None:
        return x
    spec = logical_to_spec(axes, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# --------------------------------------------------------------------------------------
# The parameters' logical axes: one reader of the annotations made in model/qwen3.py
# --------------------------------------------------------------------------------------
def path_names(path: Sequence[Any]) -> tuple[str, ...]:
    """A pytree path (jax keys, or plain names and indices) as names.  A Variable's own ``value``
    step is dropped, so a parameter has the same names in an ``nnx.State`` and a pure dict."""
    names = (str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    return tuple(n for n in names if n not in ("value", "raw_value"))


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def logical_axes(tree: Any) -> dict[tuple[str, ...], Axes]:
    """Every parameter's logical axes by its path names, from its ``out_sharding`` annotation.

    ``tree``: a module, an ``nnx.State`` or any pytree holding Variables (a drafter's params).
    A parameter without an annotation, or with one whose length is not its rank, is a
    ``ValueError`` naming it: left alone it would be replicated on every device.
    """
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    out: dict[tuple[str, ...], Axes] = {}
    for path, var in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)[0]:
        if not _is_variable(var):
            continue
        name = path_names(path)
        ndim = len(getattr(var.get_value(), "shape", ()))
        axes = var.get_metadata().get("out_sharding")
        if axes is None:
            if isinstance(var, nnx.Param) or ndim:
                raise ValueError(f"parameter {'.'.join(name)} has no logical axes: declare them where it "
                                 f"is made, nnx.Param(value, out_sharding=(...))")
            continue  # a scalar that is not a parameter (a counter): replicated
        if len(tuple(axes)) != ndim:
            raise ValueError(f"parameter {'.'.join(name)}: logical axes {tuple(axes)} do not match its "
                             f"rank {ndim}")
        out[name] = tuple(axes)
    return out


def leaf_axes(path: Sequence[Any], ndim: int, axes: Mapping[tuple[str, ...], Axes]) -> Axes:
    """Logical axes of a leaf of a tree made from the parameters, by the parameter's path inside it.

    The parameters themselves (maybe under a prefix, as the train state's ``params``), their
    gradients and optimiser moments (``mu``/``nu``, or an 8-bit moment's ``codes``/``scales``
    after the path, which keep the parameter's rank).  Scalars (step counts) are replicated; any
    other leaf is an error.
    """
    names = path_names(path)
    for start in range(len(names)):
        for end in (len(names), len(names) - 1):
            found = axes.get(names[start:end])
            if found is not None and len(found) == ndim:
                return found
    if ndim == 0:
        return ()
    raise ValueError(f"{'.'.join(names)}: a rank-{ndim} leaf that belongs to no parameter (no logical "
                     f"axes to shard it by)")


def leaf_spec(path: Sequence[Any], shape: Sequence[int], axes: Mapping[tuple[str, ...], Axes], mesh: AnyMesh,
              rules: Mapping[str, Any] | None = None) -> P:
    """The PartitionSpec of one leaf (:func:`leaf_axes`) on ``mesh``; ``rules``: a rules dict."""
    return logical_to_spec(leaf_axes(path, len(shape), axes), shape, mesh,
                           rules if rules is not None else rules_dict())


def tree_shardings(tree: Any, axes: Mapping[tuple[str, ...], Axes], mesh: AnyMesh,
                   rules: Sequence[tuple[str, Any]] | None = None) -> Any:
    """A NamedSharding for every leaf of ``tree`` (parameters, train or optimiser state), by ``axes``
    (:func:`logical_axes` of the model) and ``rules`` (``DEFAULT_RULES`` overridden)."""
    rd = rules_dict(rules)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, leaf_spec(p, getattr(x, "shape", ()), axes, mesh, rd)), tree)


def state_shardings(state: Any, mesh: AnyMesh, rules: Sequence[tuple[str, Any]] | None = None) -> Any:
    """NamedShardings for a pytree that holds the model's Variables (an ``nnx.State``)."""
    return tree_shardings(state, logical_axes(state), mesh, rules)


def shard_model(model: Any, mesh: Mesh | None, rules: Sequence[tuple[str, Any]] | None = None) -> Any:
    """Place every parameter of an NNX model on ``mesh`` by its logical axes (in place)."""
    if mesh is None:
        return model
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, state_shardings(state, mesh, rules)))
    return model


def _count(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def resolve_slices(target_devices=None, drafter_devices=None, devices=None, *, halves: bool = False
                   ) -> tuple[list[jax.Device], list[jax.Device]]:
    """Target and drafter device lists: the one device-split rule of every command.

    Counts (``--target-devices N --drafter-devices M``): the target takes the first N devices and
    the drafter the next M, disjoint.  A target count alone: the drafter shares the target's
    slice (vLLM's ``--tensor-parallel-size``).  A drafter count alone: the target takes the rest.
    Neither: both share the first device, or with ``halves`` (a benchmark of async overlap)
    disjoint halves whenever two devices exist.  Device lists: disjoint or identical (shared).
    """
    devices = list(jax.devices() if devices is None else devices)
    if target_devices is None and drafter_devices is None:
        if halves and len(devices) >= 2:
            return devices[:len(devices) - len(devices) // 2], devices[len(devices) - len(devices) // 2:]
        return devices[:1], devices[:1]
    if all(_count(x) or x is None for x in (target_devices, drafter_devices)):
        return _split_counts(target_devices, drafter_devices, devices)
    if _count(target_devices) or _count(drafter_devices):
        raise ConfigError("decoder.target_devices/drafter_devices: give both as counts or both as "
                          "device lists")
    t, d = list(target_devices or []), list(drafter_devices or [])
    if not t or not d:
        raise ConfigError("decoder.target_devices/drafter_devices: give both device lists (non-empty)")
    known = {x.id for x in devices}
    for name, lst in (("target_devices", t), ("drafter_devices", d)):
        missing = [x for x in lst if getattr(x, "id", None) not in known]
        if missing:
            raise ConfigError(f"decoder.{name}: {missing[0]!r} is not one of the {len(devices)} devices")
    check_disjoint(t, d)
    return t, d


def _split_counts(t: int | None, d: int | None, devices: list) -> tuple[list, list]:
    n = len(devices)
    for name, value in (("target_devices", t), ("drafter_devices", d)):
        if value is not None and value < 1:
            raise ConfigError(f"decoder.{name}: must be >= 1, got {value}")
    if t is not None and d is None:
        if t > n:
            raise ConfigError(f"decoder.target_devices = {t} but only {n} devices exist")
        return devices[:t], devices[:t]
    if t is None:
        t = n - d
        if t < 1:
            raise ConfigError(f"decoder.drafter_devices = {d} leaves no device for the target "
                              f"({n} devices exist)")
    if t + d > n:
        raise ConfigError(f"decoder.target_devices + decoder.drafter_devices = {t + d} but only "
                          f"{n} devices exist")
    return devices[:t], devices[t:t + d]


@functools.lru_cache(maxsize=None)
def _slice_mesh(devices: tuple) -> Mesh:
    return make_mesh(MeshConfig(data=1, fsdp=1, tensor=-1), devices)


def slice_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """The tensor-parallel mesh of one slice (heads, KV heads and the MLP split over it): the
    same Mesh object for the same devices, so a model loaded onto it is already placed."""
    return _slice_mesh(tuple(devices))


def _param_shardings(tree: Any, mesh: Mesh) -> Any:
    """Parameters (Variables) by their logical axes; any other leaf (a replay drafter's numbers)
    replicated."""
    axes, rd = logical_axes(tree), rules_dict()

    def one(path, x):
        found = axes.get(path_names(path))
        spec = logical_to_spec(found, x.shape, mesh, rd) if found is not None else P()
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, tree)


def _is_cache(x: Any) -> bool:
    # a per-layer cache's k_lbskh is a stacked copy: ask for its layers first
    return hasattr(x, "k_layers") or (hasattr(x, "k_lbskh") and hasattr(x, "v_lbskh"))


def _put_shardings(tree: Any, mesh: Mesh) -> Any:
    """Replicated, but a KV cache ``[layers, rows, length, kv_heads, head_dim]`` (or per layer
    ``[rows, kv_heads, length, head_dim]``) split over its KV
    heads as the attention that writes it is: each device holds its heads' cache only."""
    rep = NamedSharding(mesh, P())

    def one(x):
        if not _is_cache(x):
            return rep
        axes = {5: (None, None, None, "kv_heads", None), 4: (None, "kv_heads", None, None)}  # stacked, per layer
        kv = lambda a: NamedSharding(mesh, logical_to_spec(axes[a.ndim], a.shape, mesh, rules_dict()))  # noqa: E731
        return jax.tree.map(lambda a: kv(a) if getattr(a, "ndim", 0) in axes else rep, x)

    return jax.tree.map(one, tree, is_leaf=_is_cache)


def placer(devices: list[jax.Device], mesh: bool = False) -> tuple[Callable, Callable]:
    """``(place_params, place)``: parameters by the logical rules on the slice, the rest replicated
    (a KV cache split over KV heads).  One device without ``mesh``: plain ``device_put``."""
    if len(devices) == 1 and not mesh:
        dev = devices[0]
        return (lambda tree: jax.device_put(tree, dev)), (lambda tree: jax.device_put(tree, dev))
    m = slice_mesh(devices)
    return ((lambda tree: jax.device_put(tree, _param_shardings(tree, m))),
            (lambda tree: jax.device_put(tree, _put_shardings(tree, m))))


def slice_shardings(tree: Any, mesh: Mesh, *, params: bool) -> Any:
    """The shardings :func:`placer` gives ``tree`` on a slice's mesh (``params``: by the logical
    rules; else replicated, a KV cache over KV heads); abstract trees too, for a compile-only plan."""
    return (_param_shardings if params else _put_shardings)(tree, mesh)


@dataclasses.dataclass(frozen=True)
class Slices:
    """Where each side of a decoder lives, and how its trees get there."""

    target: list[jax.Device]
    drafter: list[jax.Device]
    place_target_params: Callable  # by the logical rules on the target's slice
    put_target: Callable  # replicated on the target's slice (a KV cache split over KV heads)
    place_drafter_params: Callable
    put_drafter: Callable

    @property
    def shared(self) -> bool:
        """One slice for both: nothing moves between the sides."""
        return list(self.target) == list(self.drafter)


def fused(mode: str) -> bool:
    """Modes whose rounds run drafter and target in one program: the drafter lives on the
    target's slice there (only async overlaps the two on slices of their own)."""
    return mode != "async"


def decoding_slices(mode: str, target_devices=None, drafter_devices=None, devices=None, *,
                    halves: bool = False) -> tuple[list[jax.Device], list[jax.Device]]:
    """The devices each side of a ``mode`` decoder runs on (:func:`resolve_slices`; in the fused
    modes the drafter's are the target's)."""
    t, d = resolve_slices(target_devices, drafter_devices, devices, halves=halves)
    return (t, t) if fused(mode) else (t, d)


def model_meshes(mode: str, target_devices=None, drafter_devices=None) -> tuple[Mesh | None, Mesh | None]:
    """The meshes a command loads target and drafter onto, so each tensor lands on its slice as it
    is read (no whole copy on one device first); ``(None, None)`` when no split was asked."""
    if target_devices is None and drafter_devices is None:
        return None, None
    t, d = decoding_slices(mode, target_devices, drafter_devices)
    return slice_mesh(t), slice_mesh(d)


def place_slices(target_devices=None, drafter_devices=None, devices=None, *, mode: str = "async") -> Slices:
    """The two slices (:func:`decoding_slices`) and their placers (:func:`placer`), in one call.
    A split that was asked for places on meshes, so models loaded by :func:`model_meshes` stay put."""
    t_devs, d_devs = decoding_slices(mode, target_devices, drafter_devices, devices)
    asked = target_devices is not None or drafter_devices is not None
    (t_params, t_put), (d_params, d_put) = placer(t_devs, asked), placer(d_devs, asked)
    return Slices(t_devs, d_devs, t_params, t_put, d_params, d_put)


def devices_of(leaves: Sequence[Any]) -> list[jax.Device]:
    """The devices holding any of ``leaves`` (arrays), by id."""
    found = {d.id: d for x in leaves if isinstance(x, jax.Array) for d in x.sharding.device_set}
    return [found[i] for i in sorted(found)]


def bytes_per_device(leaves: Sequence[Any]) -> int:
    """The bytes ``leaves`` keep on their most loaded device (each device's own shards)."""
    per: dict[int, int] = {}
    for x in leaves:
        if isinstance(x, jax.Array):
            for shard in x.addressable_shards:
                per[shard.device.id] = per.get(shard.device.id, 0) + shard.data.nbytes
    return max(per.values(), default=0)
