"""Checkpoints.

Param-only export for inference (MaxText style): ``save_params(model, dir)`` writes

* ``dir/d3d_model_config.json`` – our :class:`ModelConfig` (incl. ``mask_token_id``/``block_size``),
* ``dir/params/``               – the parameters as an Orbax checkpoint,

and ``load_model(path, mesh=None)`` reads either such a directory or a Hugging Face Qwen3
directory, restoring every array straight into its sharding on ``mesh``.
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
from d3d_jax.model.qwen3 import Qwen3, abstract_model
from d3d_jax.parallel.sharding import param_sharding, rules_dict

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
    """Write the model's config and parameters (param-only Orbax checkpoint, for inference)."""
    import orbax.checkpoint as ocp

    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    params = _str_keys(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(directory / PARAMS_DIR, params, force=True)
    ckptr.wait_until_finished()
    with open(directory / PARAMS_CONFIG_FILE, "w") as f:
        json.dump({"format": _FORMAT, "model": dataclasses.asdict(model.config)}, f, indent=2)
    return directory


def read_params_config(directory: str | os.PathLike) -> ModelConfig:
    path = Path(directory) / PARAMS_CONFIG_FILE
    with open(path) as f:
        data = json.load(f)
    if data.get("format") != _FORMAT or "model" not in data:
        raise ConfigError(f"{path}: not a d3d_jax parameter checkpoint (format {data.get('format')!r})")
    cfg = build_dataclass(ModelConfig, data["model"], "model")
    cfg.validate()
    return cfg


def is_params_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / PARAMS_CONFIG_FILE).exists()


def load_model(path: str | os.PathLike, mesh: Mesh | None = None, dtype: str | None = None, *,
               rules: Sequence[tuple[str, Any]] | None = None, **config_overrides: Any) -> Qwen3:
    """A :class:`Qwen3` from an exported parameter checkpoint or an HF Qwen3 directory.

    ``dtype`` casts parameters (and the compute dtype) after loading; ``config_overrides`` replace
    ModelConfig fields that do not change shapes (e.g. ``gradient_checkpointing``).
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
            return load_qwen3(path, mesh=mesh, dtype=dtype, rules=rules, **config_overrides)
        raise ConfigError(f"{path}: neither {PARAMS_CONFIG_FILE} (d3d_jax checkpoint) nor "
                          f"config.json (HF directory) found")

    import orbax.checkpoint as ocp

    stored_cfg = read_params_config(path)
    model = abstract_model(stored_cfg)
    graphdef, state = nnx.split(model)
    abstract = nnx.to_pure_dict(state)
    rd = rules_dict(rules)
    device = SingleDeviceSharding(jax.devices()[0])

    def target(p, x):
        sharding = param_sharding(p, x.shape, mesh, rd) if mesh is not None else device
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    abstract_target = jax.tree_util.tree_map_with_path(target, abstract)
    restored = ocp.StandardCheckpointer().restore(path.resolve() / PARAMS_DIR, _str_keys(abstract_target))
    pure = _int_keys_like(restored, abstract)
    changes = dict(config_overrides)
    if dtype is not None:
        pure = jax.tree_util.tree_map(lambda x: x.astype(jnp.dtype(dtype)), pure)
        changes.update(param_dtype=dtype, dtype=dtype)
    if changes:
        cfg = dataclasses.replace(stored_cfg, **changes)
        cfg.validate()
        graphdef, state = nnx.split(abstract_model(cfg))
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


# --------------------------------------------------------------------------------------
# Train-state checkpoints (issue 4, training helper): Orbax CheckpointManager holding the
# train state (params + optimiser state + step), the data iterator's state and the run config;
# keeps the newest N, saves asynchronously, resumes from the latest.
# --------------------------------------------------------------------------------------
def _flat_key(path: Any) -> str:
    parts = []
    for p in path:
        v = getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))
        parts.append(str(v))
    return ".".join(parts)


def flatten_state(state: Any) -> dict[str, Any]:
    """``{dotted path: array}`` of a pytree (an nnx.State of model + optimiser, custom nodes
    included): a flat dict Orbax stores without caring about the tree's node types."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    out = {_flat_key(p): x for p, x in flat}
    if len(out) != len(flat):
        raise ValueError("flatten_state: two leaves share a path name")
    return out


def unflatten_state(flat: dict[str, Any], like: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [flat[_flat_key(p)] for p, _ in leaves])


class TrainCheckpointer:
    """``save(step, state, data_state, config)`` / ``restore_latest(abstract_state)``.

    ``data_state`` is the grain iterator's ``get_state()`` snapshot taken *before* the async
    save starts (so a prefetching iterator cannot move under it); one JSON item, written by the
    primary process: every process's iterator is at the same global batch
    (:func:`d3d_jax.training.data.batch_shard`), so a run on any number of processes resumes it.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3, async_save: bool = True):
        import orbax.checkpoint as ocp

        self.directory = Path(directory).resolve()
        self._ocp = ocp
        self._data_item = "data"
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_state: Any, config: dict | None = None) -> None:
        ocp = self._ocp
        items = {"state": ocp.args.StandardSave(flatten_state(state)),
                 self._data_item: ocp.args.JsonSave(data_state)}
        if config is not None:
            items["config"] = ocp.args.JsonSave(config)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, Any]:
        """``(state, data_state)`` of ``step``; ``abstract_state`` leaves carry shape, dtype, sharding."""
        ocp = self._ocp
        target = flatten_state(jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            abstract_state))
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), **{self._data_item: ocp.args.JsonRestore()}))
        return unflatten_state(out["state"], abstract_state), out[self._data_item]

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, Any] | None:
        step = self.latest_step()
        if step is None:
            return None
        state, data_state = self.restore(step, abstract_state)
        return step, state, data_state

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
