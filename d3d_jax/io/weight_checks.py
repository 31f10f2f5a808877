"""Weights checked where they enter and leave: a floating-point dtype, the config's shapes and
finite values, each failure one line naming the file and the tensor.

One finiteness check serves loading (HF safetensors and Orbax parameter checkpoints, target and
drafter alike: :func:`check_loaded_finite`) and export (:func:`check_finite_params`).  It runs
on the placed parameters, one vectorised reduction per leaf (per layer of a stacked leaf), all
in one program read back in one transfer: a single pass over memory the device reads at full
bandwidth, small beside reading the file.  A NaN in one element of a norm weight used to
load and decode to token 0 forever; a header that relabelled bf16 bytes as ``I16`` loaded as
integers cast to float (mean |w| 16,384 instead of 0.03).  Dtype and shape are checked from the
header or the checkpoint's metadata, before anything is read.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from d3d_jax.errors import ModelFileError, NonFiniteError

# a parameter's path in the pure parameter tree: ("layers", "mlp", "up_proj", "kernel") for a stacked
# leaf (layer axis first), ("layers", 0, "mlp", ...) for one layer of an unstacked model
Path_ = tuple


def require_float(dtype: Any, where: str) -> None:
    """``where`` names the tensor; every Qwen3 parameter is floating point, so an integer or
    boolean dtype means a damaged or mislabelled file (casting it would load garbage)."""
    ok = False
    try:
        ok = jnp.issubdtype(np.dtype(dtype), jnp.floating)
    except TypeError:
        pass
    if not ok:
        raise ModelFileError(f"{where} is stored as {dtype}, not a floating-point type: every weight is a "
                             "float, so the file is damaged or its header mislabels the tensor")


def _is_stacked(path: Path_) -> bool:
    return path[0] == "layers" and len(path) > 1 and not isinstance(path[1], int)


@functools.partial(jax.jit, static_argnums=0)
def _finite_flags(stacked: tuple[bool, ...], xs: list) -> list:
    # One program for every leaf: a reduction per leaf dispatched eagerly is a program per leaf,
    # and on a sharded model many of them in flight deadlocked XLA:CPU's in-process all-reduce.
    return [jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim))) if s else jnp.all(jnp.isfinite(x))
            for s, x in zip(stacked, xs)]


HOST_CHUNK = 1 << 22  # elements per host pass: the flags of a chunk, never of a whole leaf, in memory


def _host_finite(stacked: bool, x) -> np.ndarray:
    """:func:`_finite_flags` of one leaf held in host memory, read in place chunk by chunk."""
    rows = np.asarray(x).reshape((x.shape[0] if stacked else 1), -1)
    ok = np.ones((rows.shape[0],), bool)
    for r, row in enumerate(rows):
        for k in range(0, row.size, HOST_CHUNK):
            if not ok[r]:
                break
            ok[r] = np.isfinite(row[k: k + HOST_CHUNK]).all()
    return ok if stacked else ok[0]


def _on_host(x) -> bool:
    """In this process's memory: numpy (an export's gathered copy), or a jax array on CPU
    devices that are all this process's."""
    if not isinstance(x, jax.Array):
        return True
    return all(d.platform == "cpu" for d in x.devices()) and x.is_fully_addressable


def finite_flags(stacked: tuple[bool, ...], xs: list) -> list:
    """Per leaf: all finite (per layer of a stacked leaf).  Leaves in host memory (a CPU backend)
    are read there: a program of one reduction per leaf costs a CPU start 0.5 s of XLA compile
    per model, more than reading the weights."""
    if all(_on_host(x) for x in xs):
        return [_host_finite(s, x) for s, x in zip(stacked, xs)]
    return jax.device_get(_finite_flags(stacked, xs))


def first_nonfinite(pure: Any) -> tuple[Path_, int | None, int, int] | None:
    """``(path, layer, count, size)`` of the first parameter holding NaN/inf (``layer``: the row
    of a stacked leaf, else None), or None when every value is finite."""
    leaves = [(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p), x)
              for p, x in jax.tree_util.tree_flatten_with_path(pure)[0]]
    flags = finite_flags(tuple(_is_stacked(p) for p, _ in leaves), [x for _, x in leaves])
    for (path, x), ok in zip(leaves, flags):
        for layer, fine in enumerate(np.atleast_1d(ok)):
            if not fine:
                part = x[layer] if _is_stacked(path) else x
                return path, (layer if _is_stacked(path) else None), int(jnp.sum(~jnp.isfinite(part))), part.size
    return None


def dotted_name(path: Path_, layer: int | None) -> str:
    """``layers.1.mlp.up_proj.kernel`` for layer 1 of a stacked leaf."""
    parts = [str(p) for p in path]
    return ".".join(parts[:1] + ([str(layer)] if layer is not None else []) + parts[1:])


def check_finite_params(model: Any, dest: str | os.PathLike) -> None:
    """Refuse to export NaN / inf weights (:class:`NonFiniteError` naming the first bad tensor,
    a stacked layer parameter by its layer: ``layers.1.mlp.up_proj.kernel``)."""
    bad = first_nonfinite(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    if bad is not None:
        path, layer, count, size = bad
        raise NonFiniteError(f"{dest}: not exported: parameter {dotted_name(path, layer)} has {count} NaN/inf "
                             f"values of {size}")


def check_loaded_finite(pure: Any, describe: Callable[[Path_, int | None], str]) -> None:
    """After loading: :class:`ModelFileError` when a weight holds NaN/inf; ``describe(path,
    layer)`` names its file and tensor."""
    bad = first_nonfinite(pure)
    if bad is not None:
        path, layer, count, size = bad
        raise ModelFileError(f"{describe(path, layer)} has {count} NaN/inf values of {size}: the weights are "
                             "damaged (a model with them decodes garbage)")


def check_stored_leaves(stored: Sequence[tuple[Path_, tuple, Any]], expected: dict[Path_, tuple],
                        where: str) -> None:
    """A checkpoint's ``(path, shape, dtype)`` leaves against the ``{path: shape}`` its config
    implies: every leaf present, of that shape and a floating-point dtype."""
    seen = {p: (s, d) for p, s, d in stored}
    for path, shape in expected.items():
        name = f"{where}: tensor {dotted_name(path, None)}"
        if path not in seen:
            raise ModelFileError(f"{name} is missing from the checkpoint")
        got, dtype = seen[path]
        if tuple(got) != tuple(shape):
            raise ModelFileError(f"{name} has shape {tuple(got)}, but the checkpoint's config implies {tuple(shape)}")
        require_float(dtype, name)
