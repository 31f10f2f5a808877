"""Checkpoints.

Param-only export for inference (MaxText style): ``save_params(model, dir)`` writes

* ``dir/d3d_model_config.json`` – our :class:`ModelConfig` (incl. ``mask_token_id``/``block_size``),
* ``dir/params/``               – the parameters as an Orbax checkpoint,
* ``dir/d3d_manifest.json``     – size and sha256 of every file above (``d3d_jax.io.manifest``),

and ``load_model(path, mesh=None)`` reads either such a directory (checksums verified first: a
damaged export fails with one :class:`CheckpointError`) or a Hugging Face Qwen3 directory,
restoring every array straight into its sharding on ``mesh``.  Train-state checkpoints live in
``d3d_jax.training.checkpoints``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from d3d_jax.config import DTYPES, ConfigError, ModelConfig, build_dataclass
from d3d_jax.io.files import read_json
from d3d_jax.io.weight_checks import check_loaded_finite, check_stored_leaves, dotted_name
from d3d_jax.io.manifest import MANIFEST_FILE, CheckpointError, verify_manifest, write_manifest
from d3d_jax.model.qwen3 import Qwen3, abstract_model
from d3d_jax.parallel.sharding import logical_axes, tree_shardings

PARAMS_CONFIG_FILE = "d3d_model_config.json"
PARAMS_DIR = "params"
_FORMAT = "d3d_jax.params/v1"


def _str_keys(tree: Any) -> Any:
    """Orbax stores dict keys as strings; layer indices become "0", "1", ... and back."""
    if isinstance(tree, dict):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree


def _int_keys_like(tree: Any, like: Any) -> Any:
    if isinstance(like, dict):
        return {k: _int_keys_like(tree[str(k)], v) for k, v in like.items()}
    return tree


def save_params(model: Qwen3, directory: str | os.PathLike) -> Path:
    """Write the model's config and parameters (param-only Orbax checkpoint, for inference).

    Written beside ``directory`` and renamed into place (:mod:`d3d_jax.io.atomic`): a kill at any
    moment leaves the previous export whole."""
    import orbax.checkpoint as ocp

    from d3d_jax.io.atomic import staged_directory
    from d3d_jax.io.weight_checks import check_finite_params

    check_finite_params(model, directory)
    primary = jax.process_index() == 0
    params = _str_keys(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    with staged_directory(directory, primary=primary, barrier=_sync,
                          keep=lambda name: name not in (PARAMS_DIR, PARAMS_CONFIG_FILE, MANIFEST_FILE)) as tmp:
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(tmp / PARAMS_DIR, params, force=True)
        ckptr.wait_until_finished()
        if primary:
            with open(tmp / PARAMS_CONFIG_FILE, "w") as f:
                json.dump({"format": _FORMAT, "model": dataclasses.asdict(model.config.portable())}, f,
                          indent=2)
            write_manifest(tmp)
    return Path(directory).resolve()


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def read_params_config(directory: str | os.PathLike) -> ModelConfig:
    path = Path(directory) / PARAMS_CONFIG_FILE
    data = read_json(path, PARAMS_CONFIG_FILE, ConfigError)
    if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(data.get("model"), dict):
        raise ConfigError(f"{path}: not a d3d_jax parameter checkpoint")
    try:
        cfg = build_dataclass(ModelConfig, data["model"], "model")
        cfg.validate()
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return cfg


def stored_model_config(path: str | os.PathLike) -> ModelConfig:
    """The :class:`ModelConfig` of a parameter checkpoint or HF directory, without loading weights."""
    if is_params_checkpoint(path):
        return read_params_config(path)
    from d3d_jax.io.hf import load_config

    return load_config(path)


def _leaves(tree: Any) -> list[tuple[tuple, Any]]:
    return [(tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in p), x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _check_stored(ckptr: Any, params_dir: Path, abstract: Any) -> None:
    """Every stored array's shape and dtype against the config, from Orbax's metadata (nothing
    read yet): Orbax would otherwise cast integers to floats and pad or cut a mis-shaped array."""
    meta = ckptr.metadata(params_dir)
    stored = [(p, tuple(m.shape), m.dtype) for p, m in _leaves(getattr(meta, "item_metadata", meta))]
    check_stored_leaves(stored, {p: tuple(x.shape) for p, x in _leaves(abstract)}, str(params_dir))


def is_params_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / PARAMS_CONFIG_FILE).exists()


def load_decoding_model(path: str | os.PathLike, *, dtype: str | None = None, attention: str = "auto",
                        mesh: Mesh | None = None, rules: Sequence[tuple[str, Any]] | None = None) -> Qwen3:
    """A model as decoders run it: one module per layer, read straight into that layout, on the
    attention backend ``attention`` (``auto``/``xla``/``pallas``, the commands' ``--attention``)
    resolves to for this platform and model (:func:`~d3d_jax.config.model.decoding_attention`)."""
    from d3d_jax.config.model import decoding_attention

    backend = attention
    if Path(path).is_dir():  # else load_model names the bad path
        backend = decoding_attention(attention, stored_model_config(path))
    return load_model(path, mesh=mesh, dtype=dtype, rules=rules, stacked=False, attention_backend=backend)


def load_model(path: str | os.PathLike, mesh: Mesh | None = None, dtype: str | None = None, *,
               rules: Sequence[tuple[str, Any]] | None = None, stacked: bool = True,
               **config_overrides: Any) -> Qwen3:
    """A :class:`Qwen3` from an exported parameter checkpoint or an HF Qwen3 directory.

    ``dtype`` casts parameters (and the compute dtype) after loading; ``config_overrides`` replace
    ModelConfig fields that do not change shapes (e.g. ``gradient_checkpointing``).
    ``stacked=False``: one module per layer, as decoders run it (an HF directory loads so
    directly; a parameter checkpoint is unstacked after restoring).
    """
    path = Path(path)
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype: must be one of {DTYPES}, got {dtype!r}")
    if not path.is_dir():
        raise ConfigError(f"{path}: not a directory (expected an HF Qwen3 directory or a "
                          f"d3d_jax parameter checkpoint)")
    if not is_params_checkpoint(path):
        if (path / "config.json").exists():
            from d3d_jax.io.hf import load_qwen3
            return load_qwen3(path, mesh=mesh, dtype=dtype, rules=rules, stacked=stacked, **config_overrides)
        raise ConfigError(f"{path}: neither {PARAMS_CONFIG_FILE} (d3d_jax checkpoint) nor "
                          f"config.json (HF directory) found")

    import orbax.checkpoint as ocp

    _, problem = verify_manifest(path)
    if problem:
        raise CheckpointError(f"{path}: damaged parameter checkpoint: {problem}; export it again")
    stored_cfg = read_params_config(path)
    model = abstract_model(stored_cfg)
    graphdef, state = nnx.split(model)
    abstract = nnx.to_pure_dict(state)
    device = SingleDeviceSharding(jax.devices()[0])
    shardings = (tree_shardings(abstract, logical_axes(state), mesh, rules) if mesh is not None
                 else jax.tree.map(lambda _: device, abstract))
    abstract_target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                   abstract, shardings)
    params_dir = path.resolve() / PARAMS_DIR
    _check_stored(ocp.StandardCheckpointer(), params_dir, abstract)
    restored = ocp.StandardCheckpointer().restore(params_dir, _str_keys(abstract_target))
    pure = _int_keys_like(restored, abstract)
    check_loaded_finite(pure, lambda leaf, layer: f"{params_dir}: tensor {dotted_name(leaf, layer)}")
    changes = dict(config_overrides)
    if dtype is not None:
        pure = jax.tree_util.tree_map(lambda x: x.astype(jnp.dtype(dtype)), pure)
        changes.update(param_dtype=dtype, dtype=dtype)
    if changes:
        cfg = dataclasses.replace(stored_cfg, **changes)
        cfg.validate()
        graphdef, state = nnx.split(abstract_model(cfg))
    nnx.replace_by_pure_dict(state, pure)
    model = nnx.merge(graphdef, state)
    if stacked:
        return model
    from d3d_jax.model.qwen3 import unstacked

    return unstacked(model)
