"""Hugging Face Qwen3 checkpoints in and out, and the tokenizer with its ``<|MASK|>`` token.

Public entry point::

    from d3d_jax.io.hf import load_qwen3
    model = load_qwen3("path/to/Qwen3-8B")            # config.json + *.safetensors
    logits = model(tokens)                              # [batch, length] ids -> [batch, length, vocab]

``load_qwen3`` builds the module abstractly (no memory), then reads one tensor at a time from
memory-mapped safetensors, converts layout and dtype, and places it directly with its final
sharding when a mesh is given, so a checkpoint never has to fit on one device.
``save_qwen3`` writes a directory ``transformers.Qwen3ForCausalLM.from_pretrained`` loads.

Layouts: HF ``nn.Linear.weight`` is ``[out, in]``; ours keep ``in`` first and split heads:
``q_proj [d, n, h]``, ``k/v_proj [d, k, h]``, ``o_proj [n, h, d]``, MLP ``[d, f] / [f, d]``,
``lm_head [d, v]``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from d3d_jax.config import DTYPES, ConfigError, ModelConfig
from d3d_jax.errors import ModelFileError
from d3d_jax.io import safetensors_io as st
from d3d_jax.io.files import check_regular, read_json
from d3d_jax.io.weight_checks import check_finite_params, check_loaded_finite, require_float
from d3d_jax.model.qwen3 import Qwen3, abstract_model
from d3d_jax.parallel.sharding import logical_axes, tree_shardings

MASK_TOKEN = "<|MASK|>"

# a parameter's path as a mapping names it, e.g. ("layers", 0, "self_attn", "q_proj", "kernel"): layer 0's
# rows of the stacked ("layers", "self_attn", "q_proj", "kernel") (:func:`stacked_path`)
PurePath = tuple


# --------------------------------------------------------------------------------------
# Name / layout mapping
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TensorMapping:
    ours: PurePath
    hf_name: str
    hf_shape: tuple[int, ...]
    ours_shape: tuple[int, ...]
    linear: bool  # HF [out, in] <-> ours [in, *out split]

    def to_ours(self, w: np.ndarray) -> np.ndarray:
        return w.T.reshape(self.ours_shape) if self.linear else w

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(self.hf_shape[::-1]).T if self.linear else x


def tensor_mappings(cfg: ModelConfig) -> list[TensorMapping]:
    """Every parameter of our Qwen3 with its HF name and both shapes."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out = [TensorMapping(("embed_tokens", "embedding"), "model.embed_tokens.weight", (v, d), (v, d), False)]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."

        def lin(path, name, hf_shape, ours_shape):
            out.append(TensorMapping(("layers", i) + path, p + name, hf_shape, ours_shape, True))

        def vec(path, name, size):
            out.append(TensorMapping(("layers", i) + path, p + name, (size,), (size,), False))

        lin(("self_attn", "q_proj", "kernel"), "self_attn.q_proj.weight", (n * h, d), (d, n, h))
        lin(("self_attn", "k_proj", "kernel"), "self_attn.k_proj.weight", (k * h, d), (d, k, h))
        lin(("self_attn", "v_proj", "kernel"), "self_attn.v_proj.weight", (k * h, d), (d, k, h))
        lin(("self_attn", "o_proj", "kernel"), "self_attn.o_proj.weight", (d, n * h), (n, h, d))
        vec(("self_attn", "q_norm", "scale"), "self_attn.q_norm.weight", h)
        vec(("self_attn", "k_norm", "scale"), "self_attn.k_norm.weight", h)
        vec(("input_layernorm", "scale"), "input_layernorm.weight", d)
        vec(("post_attention_layernorm", "scale"), "post_attention_layernorm.weight", d)
        lin(("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", (f, d), (d, f))
        lin(("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", (f, d), (d, f))
        lin(("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", (d, f), (f, d))
    out.append(TensorMapping(("norm", "scale"), "model.norm.weight", (d,), (d,), False))
    if not cfg.tie_word_embeddings:
        out.append(TensorMapping(("lm_head", "kernel"), "lm_head.weight", (v, d), (d, v), True))
    return out


def _get_path(tree: Mapping, path: PurePath) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set_path(tree: dict, path: PurePath, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------
def read_hf_config(path: str | os.PathLike) -> dict:
    """The raw ``config.json`` of an HF directory, with clear errors for the usual mistakes."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path}: not a directory (expected an HF model directory with config.json)")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ConfigError(f"{path}: no config.json in this directory")
    hf = read_json(cfg_file, "config.json", ConfigError)
    if not isinstance(hf, dict):
        raise ConfigError(f"{cfg_file}: top level must be an object")
    return hf


def checkpoint_dtype(hf: Mapping[str, Any]) -> str:
    """The dtype a checkpoint declares (``dtype`` or legacy ``torch_dtype``), float32 if none."""
    for key in ("dtype", "torch_dtype"):
        value = hf.get(key)
        if isinstance(value, str) and value.replace("torch.", "") in DTYPES:
            return value.replace("torch.", "")
    return "float32"


def load_config(path: str | os.PathLike, dtype: str | None = None, compute_dtype: str | None = None,
                **overrides: Any) -> ModelConfig:
    """ModelConfig of an HF directory; ``dtype`` (param) defaults to the checkpoint's own."""
    hf = read_hf_config(path)
    param_dtype = dtype or checkpoint_dtype(hf)
    try:
        return ModelConfig.from_hf_dict(hf, param_dtype=param_dtype, dtype=compute_dtype or param_dtype,
                                        **overrides)
    except ConfigError as e:  # name the file: a run may load several model directories
        raise ConfigError(f"{Path(path) / 'config.json'}: {e}") from None


def _placer(mesh: Mesh | None, rules: Any, abstract: nnx.State) -> Callable[[PurePath, np.ndarray], jax.Array]:
    """``place(path, host array)``: on ``mesh`` by the logical axes the ``abstract`` state declares."""
    if mesh is None:
        return lambda path, arr: jnp.asarray(arr)
    shardings = tree_shardings(nnx.to_pure_dict(abstract), logical_axes(abstract), mesh, rules)

    def place(path: PurePath, arr: np.ndarray) -> jax.Array:
        # Each device receives only its own slice of the host array.
        return jax.make_array_from_callback(arr.shape, _get_path(shardings, path), lambda idx: arr[idx])

    return place


def load_qwen3(path: str | os.PathLike, mesh: Mesh | None = None, dtype: str | None = None, *,
               compute_dtype: str | None = None, rules: Sequence[tuple[str, Any]] | None = None,
               stacked: bool = True, **config_overrides: Any) -> Qwen3:
    """Load an HF Qwen3 directory (``config.json`` + ``model.safetensors`` or indexed shards).

    Args:
      path: the directory.
      mesh: place every parameter with its logical sharding on this mesh while loading.
      dtype: parameter dtype (``float32``/``bfloat16``/``float16``); default: the checkpoint's.
      compute_dtype: activation dtype; default: the parameter dtype.
      rules: logical-axis rules overriding ``DEFAULT_RULES``.
      stacked: the layers' parameters stacked (training, the default) or one module per layer
        (decoding: :func:`~d3d_jax.model.qwen3.unstacked`), read straight into that layout.
      config_overrides: extra ``ModelConfig`` fields (e.g. ``mask_token_id``, ``gradient_checkpointing``).

    Returns a :class:`Qwen3`; ``model(tokens_bt)`` gives float32 logits ``[B, T, V]`` for causal
    positions ``0..T-1``.
    """
    cfg = load_config(path, dtype, compute_dtype, **config_overrides)
    tensors = st.SafetensorsDir(path)
    return build_from_tensors(cfg, tensors, mesh, rules, source=str(path), stacked=stacked)


def build_from_tensors(cfg: ModelConfig, tensors: Any, mesh: Mesh | None = None, rules: Any = None,
                       source: str = "checkpoint", stacked: bool = True) -> Qwen3:
    """Fill an abstract Qwen3 from ``tensors`` (``keys/shape/get`` by HF name), one leaf at a time."""
    extra_layers = sorted({k for k in tensors.keys() if k.startswith("model.layers.")
                           and k.split(".")[2].isdigit() and int(k.split(".")[2]) >= cfg.num_layers})
    if extra_layers:  # weights for more layers than config.json declares: the config is wrong
        raise ModelFileError(f"{source}: tensor {extra_layers[0]} belongs to a layer beyond "
                             f"num_hidden_layers={cfg.num_layers} in config.json")
    model = abstract_model(cfg, stacked=stacked)
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    place = _placer(mesh, rules, state)
    pdt = np.dtype(jnp.dtype(cfg.param_dtype))
    mappings = tensor_mappings(cfg)
    for m in mappings:  # every name and shape checked before anything is read
        if m.hf_name not in tensors:
            raise ModelFileError(f"{source}: tensor {m.hf_name} is missing from the checkpoint")
        got = tuple(tensors.shape(m.hf_name))
        if got != m.hf_shape:
            raise ModelFileError(f"{source}: tensor {m.hf_name} has shape {got}, but config.json implies "
                                 f"{m.hf_shape}")
        require_float(tensors.get(m.hf_name).dtype, _where(tensors, m.hf_name, source))  # a view: reads nothing
    layers: dict[PurePath, list[np.ndarray]] = {}  # a stacked leaf's layers, placed once all are read
    for m in sorted(mappings, key=lambda m: stacked_path(m.ours)):
        arr = np.asarray(m.to_ours(tensors.get(m.hf_name))).astype(pdt)
        path = stacked_path(m.ours)[0] if stacked else m.ours
        if stacked and path[0] == "layers":
            layers.setdefault(path, []).append(arr)
            if len(layers[path]) < cfg.num_layers:
                continue
            arr = np.stack(layers.pop(path))
        expected = _get_path(pure, path)
        assert tuple(expected.shape) == arr.shape, (path, expected.shape, arr.shape)
        _set_path(pure, path, place(path, arr))
    by_path = {stacked_path(m.ours): m.hf_name for m in mappings}
    check_loaded_finite(pure, lambda path, layer: _where(
        tensors, by_path[(path, layer) if layer is not None else stacked_path(path)], source))
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _where(tensors: Any, name: str, source: str) -> str:
    """``FILE: tensor NAME``: the shard that holds it when ``tensors`` knows (a safetensors directory)."""
    file_of = getattr(tensors, "file_of", None)
    return f"{file_of(name) if file_of is not None else source}: tensor {name}"


def stacked_path(ours: PurePath) -> tuple[PurePath, int]:
    """``(path in the stacked parameter tree, layer)`` of a mapping's ``("layers", i, ...)`` path
    (layer -1 for the parameters outside the layer stack)."""
    if ours[0] == "layers":
        return ("layers",) + tuple(ours[2:]), int(ours[1])
    return tuple(ours), -1


# --------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------
def hf_tensors(model: Qwen3, dtype: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """``(HF name, host array)`` for every parameter, converted lazily one at a time."""
    cfg = model.config
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    ndt = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
    for m in tensor_mappings(cfg):
        path, layer = stacked_path(m.ours)
        x = _get_path(pure, path)
        x = np.asarray(jax.device_get(x[layer] if layer >= 0 else x))
        yield m.hf_name, np.ascontiguousarray(m.to_hf(x).astype(ndt))


def save_qwen3(model: Qwen3, out_dir: str | os.PathLike, dtype: str | None = None,
               extra_config: Mapping[str, Any] | None = None,
               max_shard_size: int | str | None = None, tokenizer: Any = None) -> Path:
    """Write ``config.json`` + safetensors that ``Qwen3ForCausalLM.from_pretrained`` loads.

    ``dtype``: stored dtype (default: the parameter dtype).  ``extra_config``: keys merged into
    config.json (``mask_token_id``/``block_size`` are written anyway when the config has them).
    ``max_shard_size`` (bytes or ``"200KB"``/``"5GB"``): split into ``model-0000i-of-0000n``
    files plus ``model.safetensors.index.json``.  ``tokenizer``: saved beside the weights.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype: must be one of {DTYPES}, got {dtype!r}")
    check_finite_params(model, out_dir)
    from d3d_jax.io.atomic import staged_directory

    # Written beside out_dir and renamed into place: a kill leaves the previous export whole.
    # Files of the old directory the export does not write (a tokenizer, result.json) stay.
    with staged_directory(out_dir, keep=lambda name: not _is_weights_file(name)) as tmp:
        _write_hf_files(model, tmp, dtype, extra_config, max_shard_size, tokenizer)
    return Path(out_dir)


def _is_weights_file(name: str) -> bool:
    """What an export rewrites: config and weights (a stale shard of another layout would confuse loaders)."""
    return name in ("config.json", st.INDEX_FILE) or (name.startswith("model") and name.endswith(".safetensors"))


def _write_hf_files(model: Qwen3, out: Path, dtype: str | None, extra_config: Mapping[str, Any] | None,
                    max_shard_size: int | str | None, tokenizer: Any) -> None:
    cfg = model.config
    stored = dtype or cfg.param_dtype
    hf_cfg = cfg.to_hf_dict(torch_dtype=stored)
    if extra_config:
        hf_cfg.update(extra_config)
    with open(out / "config.json", "w") as f:
        json.dump(hf_cfg, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))

    itemsize = jnp.dtype(stored).itemsize
    sizes = [(m.hf_name, int(np.prod(m.hf_shape)) * itemsize) for m in tensor_mappings(cfg)]
    limit = None if max_shard_size is None else st.parse_size(max_shard_size)
    shards = st.plan_shards(sizes, limit)
    tensors = hf_tensors(model, stored)
    if len(shards) == 1:
        st.write_file(out / st.SINGLE_FILE, dict(tensors))
        return
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        chunk = {}
        for _ in names:  # tensors come in the same order as the plan
            name, arr = next(tensors)
            chunk[name] = arr
            weight_map[name] = fname
            total += arr.nbytes
        st.write_file(out / fname, chunk)
    with open(out / st.INDEX_FILE, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


# --------------------------------------------------------------------------------------
# Tokenizer and the MASK token (spec §1)
# --------------------------------------------------------------------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# the other files transformers may read from a tokenizer directory
_TOKENIZER_EXTRAS = ("special_tokens_map.json", "added_tokens.json", "merges.txt", "chat_template.jinja",
                     "chat_template.json", "config.json", "generation_config.json")


def has_tokenizer(path: str | os.PathLike) -> bool:
    """Whether a directory holds tokenizer files (a model directory may have none)."""
    path = Path(path)
    return path.is_dir() and any((path / f).exists() for f in TOKENIZER_FILES)


# tokenizer_config.json classes for which every path of AutoTokenizer.from_pretrained ends in the
# tokenizers backend's own from_pretrained (transformers 5), when the directory's model (if any)
# is a Qwen3: for some model types (qwen2, phi3, ...) AutoTokenizer overrides the declared class.
# Loading those directly skips importing AutoTokenizer, which imports torch: ~6 s of a warm start.
_BACKEND_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _json_dict(path: Path) -> dict | None:
    try:
        out = read_json(path)
    except (OSError, ModelFileError):  # absent or unreadable: open_tokenizer and AutoTokenizer report it
        return None
    return out if isinstance(out, dict) else None


def _tokenizer_loader(path: Path) -> Any:
    """The class whose ``from_pretrained`` loads ``path`` as AutoTokenizer would: the tokenizers
    backend directly where that is what AutoTokenizer picks, else AutoTokenizer itself."""
    declared = _json_dict(path / "tokenizer_config.json") or {}
    config = path / "config.json"  # an unreadable one goes to AutoTokenizer, which reports it
    model_type = (_json_dict(config) or {}).get("model_type") if config.exists() else "qwen3"
    if (declared.get("tokenizer_class") in _BACKEND_CLASSES and "auto_map" not in declared
            and model_type == "qwen3" and (path / "tokenizer.json").is_file()):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def open_tokenizer(path: str | os.PathLike, *, vocab_size: int | None = None, hint: str = "") -> Any:
    """The tokenizer of a local directory; refuses a directory without one (``AutoTokenizer`` would
    otherwise build a near-empty one) and one with more tokens than the model's ``vocab_size``.
    ``hint`` ends the first error (e.g. " (pass --tokenizer DIR)")."""
    path = Path(path)
    if not path.is_dir():
        raise ModelFileError(f"{path}: not a tokenizer directory{hint}")
    if not has_tokenizer(path):
        raise ModelFileError(f"{path}: no tokenizer here (none of {', '.join(TOKENIZER_FILES)}){hint}")
    for name in TOKENIZER_FILES + _TOKENIZER_EXTRAS:  # transformers opens these by name: never a FIFO
        if (path / name).exists():
            check_regular(path / name, "a tokenizer file")
    try:
        tok = _tokenizer_loader(path).from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # tokenizers and transformers raise many types for a bad file
        raise ModelFileError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
    if vocab_size is not None and len(tok) > vocab_size:
        raise ModelFileError(f"{path}: the tokenizer has {len(tok)} tokens but the model's vocab_size is "
                             f"{vocab_size}: ids >= {vocab_size} would index past the embedding")
    return tok


def load_tokenizer(path: str | os.PathLike, vocab_size: int | None = None) -> tuple[Any, int]:
    """``(tokenizer, mask_token_id)`` from a local directory, with ``<|MASK|>`` as a special token.

    If the tokenizer already has ``<|MASK|>`` its id is used.  Otherwise the token is added at the
    first id after the tokenizer's vocabulary (``len(tokenizer)``) — for Qwen3 that is 151669, a
    row the padded 151936-row embedding already has (DFlash's convention).  When the id does not
    fit the model's embedding, call :func:`ensure_token_fits`.  ``vocab_size``: the model's; a
    tokenizer with more tokens is refused (checked before ``<|MASK|>`` is added).
    """
    tok = open_tokenizer(path, vocab_size=vocab_size)
    vocab = tok.get_vocab()
    if MASK_TOKEN not in vocab:
        tok.add_special_tokens({"mask_token": MASK_TOKEN})
    elif getattr(tok, "mask_token", None) != MASK_TOKEN:
        tok.mask_token = MASK_TOKEN
    mask_id = tok.convert_tokens_to_ids(MASK_TOKEN)
    if not isinstance(mask_id, int) or mask_id < 0:
        raise ModelFileError(f"{path}: could not assign an id to {MASK_TOKEN}")
    return tok, mask_id


def eos_token_ids(model_config: ModelConfig, tokenizer: Any = None) -> tuple[int, ...]:
    """The ids that end a response: the model config's ``eos_token_id`` (an id or a list) plus the
    tokenizer's EOS token, sorted.  One outside the vocabulary is refused, not dropped: it could
    never end a response (the config's own are refused when it is read)."""
    ids = model_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    bad = [int(i) for i in ids if not 0 <= int(i) < model_config.vocab_size]
    if bad:
        raise ModelFileError(f"EOS id {bad[0]} ({tokenizer.eos_token!r} of the tokenizer) is outside the model's "
                             f"vocabulary [0, {model_config.vocab_size})" if tokenizer is not None and
                             bad[0] == getattr(tokenizer, "eos_token_id", None) else
                             f"EOS id {bad[0]} is outside the model's vocabulary [0, {model_config.vocab_size})")
    return tuple(sorted({int(i) for i in ids}))


def _rebuild(model: Qwen3, cfg: ModelConfig, replace_leaves: Mapping[PurePath, jax.Array]) -> Qwen3:
    """A model with config ``cfg``: every leaf shared from ``model`` except ``replace_leaves``."""
    new_model = abstract_model(cfg)
    graphdef, state = nnx.split(new_model)
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for path, value in replace_leaves.items():
        _set_path(pure, path, value)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def resize_vocab(model: Qwen3, new_vocab_size: int) -> Qwen3:
    """Grow (or shrink) the embedding and LM head to ``new_vocab_size`` rows.

    New rows start as the mean of the existing embedding rows (and LM head columns), so a new
    token's logit is an average one rather than an outlier; training then shapes it.
    """
    cfg = model.config
    if new_vocab_size <= 0:
        raise ValueError(f"resize_vocab: new_vocab_size must be > 0, got {new_vocab_size}")
    old = cfg.vocab_size
    if new_vocab_size == old:
        return model
    emb = model.embed_tokens.embedding[...]
    sharding = getattr(emb, "sharding", None)

    def grow(x: jax.Array, axis: int) -> jax.Array:
        if new_vocab_size < old:
            return jax.lax.slice_in_dim(x, 0, new_vocab_size, axis=axis)
        mean = jnp.mean(x.astype(jnp.float32), axis=axis, keepdims=True).astype(x.dtype)
        extra_shape = list(x.shape)
        extra_shape[axis] = new_vocab_size - old
        return jnp.concatenate([x, jnp.broadcast_to(mean, extra_shape)], axis=axis)

    leaves = {("embed_tokens", "embedding"): grow(emb, 0)}
    if not cfg.tie_word_embeddings:
        leaves[("lm_head", "kernel")] = grow(model.lm_head.kernel[...], 1)
    mask_id = cfg.mask_token_id if (cfg.mask_token_id is None or cfg.mask_token_id < new_vocab_size) else None
    new_cfg = dataclasses.replace(cfg, vocab_size=new_vocab_size, mask_token_id=mask_id)
    new_model = _rebuild(model, new_cfg, leaves)
    if sharding is not None and hasattr(sharding, "mesh"):
        from d3d_jax.parallel.sharding import shard_model
        shard_model(new_model, sharding.mesh)
    return new_model


def ensure_token_fits(model: Qwen3, token_id: int, multiple: int = 1, *,
                      set_mask_token: bool = True, block_size: int | None = None) -> Qwen3:
    """Resize the vocabulary when ``token_id`` >= vocab_size (to a multiple of ``multiple``), and
    record it as the config's ``mask_token_id`` (plus ``block_size`` when given)."""
    if token_id < 0:
        raise ValueError(f"token id must be >= 0, got {token_id}")
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    if token_id >= model.config.vocab_size:
        size = -(-(token_id + 1) // multiple) * multiple
        model = resize_vocab(model, size)
    changes: dict[str, Any] = {}
    if set_mask_token:
        changes["mask_token_id"] = int(token_id)
    if block_size is not None:
        changes["block_size"] = int(block_size)
    if changes:
        new_cfg = dataclasses.replace(model.config, **changes)
        new_cfg.validate()
        model = _rebuild(model, new_cfg, {})
    return model
