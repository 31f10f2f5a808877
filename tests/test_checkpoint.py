"""Param-only Orbax checkpoint: save_params / load_model round trip, on one device and on a mesh."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from d3d_jax.config import ConfigError, MeshConfig, ModelConfig
from d3d_jax.errors import ModelFileError
from d3d_jax.io.checkpoint import PARAMS_CONFIG_FILE, load_model, save_params
from d3d_jax.io.hf import save_qwen3
from d3d_jax.model.qwen3 import init_model
from d3d_jax.parallel.sharding import make_mesh

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=False, mask_token_id=63, block_size=8)


def params_of(model):
    return jax.tree_util.tree_leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_param_checkpoint_round_trip(tmp_path):
    model = init_model(CFG, seed=7)
    save_params(model, tmp_path / "ckpt")
    loaded = load_model(tmp_path / "ckpt")
    assert loaded.config == CFG  # incl. mask_token_id and block_size
    for a, b in zip(params_of(model), params_of(loaded)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_param_checkpoint_stores_weights_not_runtime_choices(tmp_path, monkeypatch):
    """A checkpoint exported by a GPU run (fused attention, remat) loads on a host that cannot run
    that backend: the stored config keeps the runtime-only fields at their defaults."""
    import dataclasses

    from d3d_jax.config import model as model_cfg

    gpu_cfg = dataclasses.replace(CFG, head_dim=16, attention_backend="pallas", remat_policy="full")
    monkeypatch.setattr(model_cfg, "_platform", lambda: "gpu")  # validate as the GPU host would
    gpu_cfg.validate()
    model = init_model(dataclasses.replace(gpu_cfg, attention_backend="xla"), seed=3)
    model.config = gpu_cfg  # what the GPU run's model carries
    save_params(model, tmp_path / "ckpt")
    monkeypatch.undo()  # back on the CPU host: "pallas" would be refused here
    stored = json.loads((tmp_path / "ckpt" / PARAMS_CONFIG_FILE).read_text())["model"]
    assert (stored["attention_backend"], stored["remat_policy"]) == ("xla", "none")
    loaded = load_model(tmp_path / "ckpt")
    assert loaded.config == dataclasses.replace(gpu_cfg, attention_backend="xla", remat_policy="none")
    for a, b in zip(params_of(model), params_of(loaded)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_param_checkpoint_restores_onto_mesh_with_dtype(tmp_path):
    model = init_model(CFG, seed=7)
    save_params(model, tmp_path / "ckpt")
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    loaded = load_model(tmp_path / "ckpt", mesh=mesh, dtype="bfloat16")
    q = loaded.layers.self_attn.q_proj.kernel[...]  # [l, d, n, h]
    assert q.dtype == jnp.bfloat16 and loaded.config.param_dtype == "bfloat16"
    assert q.sharding.mesh.shape == mesh.shape and tuple(q.sharding.spec)[:3] == (None, "fsdp", "tensor")
    np.testing.assert_allclose(np.asarray(q, np.float32),
                               np.asarray(model.layers.self_attn.q_proj.kernel[...]), rtol=1e-2)


def test_load_model_reads_hf_directories_too(tmp_path):
    model = init_model(CFG, seed=1)
    save_qwen3(model, tmp_path / "hf")
    loaded = load_model(tmp_path / "hf")
    assert loaded.config == CFG
    tokens = jnp.arange(10)[None]
    forward = nnx.jit(lambda m, t: m(t))
    assert np.abs(np.asarray(forward(loaded, tokens)) - np.asarray(forward(model, tokens))).max() == 0.0


def test_load_model_errors(tmp_path):
    with pytest.raises(ConfigError, match="neither d3d_model_config.json"):
        load_model(tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        load_model(tmp_path / "nope")
    with pytest.raises(ConfigError, match="dtype"):
        load_model(tmp_path, dtype="float8")


def test_damaged_param_checkpoint_fails_with_one_clear_error(tmp_path):
    from d3d_jax.io.manifest import MANIFEST_FILE, CheckpointError

    model = init_model(CFG, seed=3)
    save_params(model, tmp_path / "ckpt")
    files = sorted(p for p in (tmp_path / "ckpt").rglob("*") if p.is_file())
    listed = json.loads((tmp_path / "ckpt" / MANIFEST_FILE).read_text())["files"]
    assert sorted(listed) == sorted(p.relative_to(tmp_path / "ckpt").as_posix() for p in files
                                    if p.name != MANIFEST_FILE)
    biggest = max(files, key=lambda p: p.stat().st_size)
    good = biggest.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2:len(good) // 2 + 64] = bytes(b ^ 0xFF for b in good[len(good) // 2:len(good) // 2 + 64])
    for damaged, phrase in ((bytes(flipped), "fails its sha256 check"), (good[:len(good) // 2], f"has {len(good) // 2} bytes, expected {len(good)}")):
        biggest.write_bytes(damaged)
        with pytest.raises(CheckpointError, match="damaged parameter checkpoint") as e:
            load_model(tmp_path / "ckpt")
        rel = biggest.relative_to(tmp_path / "ckpt").as_posix()
        assert f"{rel} {phrase}" in str(e.value) and "\n" not in str(e.value)
    biggest.write_bytes(good)
    loaded = load_model(tmp_path / "ckpt")  # repaired: loads again, equal to the saved model
    for a, b in zip(params_of(model), params_of(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _unchecked_export(model, directory, monkeypatch):
    """An export as another tool might write it: no finiteness check on the way out."""
    from d3d_jax.io import weight_checks

    with monkeypatch.context() as m:
        m.setattr(weight_checks, "check_finite_params", lambda *a: None)
        save_params(model, directory)


def test_a_non_finite_weight_in_a_param_checkpoint_is_refused_by_name(tmp_path, monkeypatch):
    model = init_model(CFG, seed=1)
    w = model.layers.self_attn.q_norm.scale
    w[...] = w[...].at[1, 2].set(jnp.nan)
    _unchecked_export(model, tmp_path / "ckpt", monkeypatch)
    for stacked in (True, False):
        with pytest.raises(ModelFileError) as e:
            load_model(tmp_path / "ckpt", stacked=stacked)
        assert str(e.value).startswith(f"{(tmp_path / 'ckpt').resolve() / 'params'}: tensor "
                                       "layers.1.self_attn.q_norm.scale has 1 NaN/inf values of 8"), str(e.value)


@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_a_param_checkpoint_of_the_wrong_dtype_or_shape_is_refused_before_restoring(tmp_path, monkeypatch, change):
    """Orbax casts a stored int32 array to the float target, and restores into another shape."""
    model = init_model(CFG, seed=1)
    if change == "dtype":
        bad = jnp.round(model.norm.scale[...] * 1000).astype(jnp.int32)
    else:
        bad = jnp.ones((CFG.hidden_size + 4,), jnp.float32)
    model.norm.scale = nnx.Param(bad)
    _unchecked_export(model, tmp_path / "ckpt", monkeypatch)
    where = f"{(tmp_path / 'ckpt').resolve() / 'params'}: tensor norm.scale"
    expected = "is stored as int32, not a floating-point type" if change == "dtype" else \
        f"has shape ({CFG.hidden_size + 4},), but the checkpoint's config implies ({CFG.hidden_size},)"
    with pytest.raises(ModelFileError) as e:
        load_model(tmp_path / "ckpt")
    assert str(e.value) == f"{where} {expected}" or str(e.value).startswith(f"{where} {expected}"), str(e.value)
