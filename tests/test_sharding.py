"""Sharding on 8 simulated CPU devices (conftest): a fsdp 4 × tensor 2 forward equals the
unsharded one; shard() is a no-op without a mesh; the target / drafter device split."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from d3d_jax.config import ConfigError, MeshConfig, ModelConfig
from d3d_jax.model.masks import TokenMeta, packed_training_meta
from d3d_jax.model.qwen3 import init_model
from d3d_jax.parallel.sharding import (bytes_per_device, check_disjoint, decoding_slices, logical_to_spec,
                                       make_mesh, resolve_slices, shard, shard_model, slice_mesh, use_mesh)

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=False)


def test_eight_devices_are_simulated():
    assert len(jax.devices()) == 8


def packed_inputs(batch):
    rng = np.random.default_rng(0)
    meta = packed_training_meta(12, np.array([2, 5]), 4, 22)
    tokens = rng.integers(0, CFG.vocab_size, (batch, 22))
    meta = TokenMeta(*(np.broadcast_to(meta[k][None], (batch, 22)).copy()
                       for k in ("positions", "block_ids", "context_end", "valid")))
    return tokens, meta


def test_fsdp4_tensor2_forward_equals_unsharded():
    tokens, meta = packed_inputs(batch=8)
    reference_model = init_model(CFG, seed=2)
    unsharded = np.asarray(nnx.jit(lambda m, t, mt: m(t, mt))(reference_model, tokens, meta))

    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    model = shard_model(init_model(CFG, seed=2), mesh)
    q = model.layers.self_attn.q_proj.kernel[...]
    assert q.sharding.spec == P(None, "fsdp", "tensor", None)  # [l, d, n, h]: d over fsdp, heads over tensor
    assert len({s.device for s in q.addressable_shards}) == 8
    assert model.lm_head.kernel[...].sharding.spec == P("fsdp", "tensor")

    with use_mesh(mesh):
        # a separate jitted function: tracing happens inside the mesh context
        sharded_forward = nnx.jit(lambda m, t, mt: m(t, mt))
        rows = NamedSharding(mesh, logical_to_spec(("batch", "length"), tokens.shape))
        assert rows.spec == P("fsdp", None)  # data is 1: only fsdp splits the rows
        tokens_d = jax.device_put(tokens, rows)
        meta_d = jax.tree_util.tree_map(lambda x: jax.device_put(x, rows), meta)
        out = sharded_forward(model, tokens_d, meta_d)
    assert out.sharding.spec == P("fsdp", None, "tensor")  # batch over fsdp, vocab over tensor
    assert np.abs(np.asarray(out) - unsharded).max() <= 1e-5


def test_shard_is_a_no_op_without_mesh():
    x = jnp.ones((4, 6))
    assert shard(x, ("batch", "act_vocab")) is x
    # and inside jit too
    assert np.array_equal(jax.jit(lambda y: shard(y, ("batch", "act_vocab")))(x), x)


def test_indivisible_dims_stay_replicated():
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    assert logical_to_spec(("embed", "vocab"), (32, 63), mesh) == P("fsdp", None)
    assert logical_to_spec(("embed", "vocab"), (30, 64), mesh) == P(None, "tensor")


def test_mesh_size_must_match_devices():
    with pytest.raises(ConfigError, match="3×2 = 6 but 8 devices"):
        make_mesh(MeshConfig(fsdp=3, tensor=2))
    with pytest.raises(ConfigError, match="does not divide"):
        make_mesh(MeshConfig(fsdp=-1, tensor=3))
    assert dict(make_mesh(MeshConfig(fsdp=-1, tensor=2)).shape) == {"data": 1, "fsdp": 4, "tensor": 2}


def test_one_device_split_rule_for_every_command():
    devices = jax.devices()
    ids = lambda pair: tuple([d.id for d in side] for side in pair)  # noqa: E731
    # counts: the target's first, the drafter's next, disjoint
    assert ids(resolve_slices(6, 2)) == (list(range(6)), [6, 7])
    # a target count alone (--tensor-parallel-size): the drafter shares its slice
    assert ids(resolve_slices(2, None)) == ([0, 1], [0, 1])
    # a drafter count alone: the target takes the rest
    assert ids(resolve_slices(None, 2)) == (list(range(6)), [6, 7])
    # neither: one shared device, or (a benchmark of async overlap) disjoint halves
    assert ids(resolve_slices()) == ([0], [0])
    assert ids(resolve_slices(halves=True)) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert ids(resolve_slices(halves=True, devices=devices[:3])) == ([0, 1], [2])
    assert ids(resolve_slices(halves=True, devices=devices[:1])) == ([0], [0])
    # the fused modes run the drafter in the target's programs: on the target's slice
    assert ids(decoding_slices("sync", 2, 1)) == ([0, 1], [0, 1])
    assert ids(decoding_slices("async", 2, 1)) == ([0, 1], [2])
    # each slice gets a mesh of its own (the same object for the same devices: loads stay put)
    target, drafter = resolve_slices(6, 2)
    assert dict(make_mesh(MeshConfig(fsdp=-1, tensor=2), target).shape)["fsdp"] == 3
    assert slice_mesh(target) is slice_mesh(list(target)) and dict(slice_mesh(drafter).shape)["tensor"] == 2


def test_split_errors_name_the_fields():
    with pytest.raises(ConfigError, match="= 10 but only 8 devices"):
        resolve_slices(6, 4)
    with pytest.raises(ConfigError, match="target_devices = 9 but only 8"):
        resolve_slices(9, None)
    with pytest.raises(ConfigError, match="drafter_devices = 8 leaves no device for the target"):
        resolve_slices(None, 8)
    with pytest.raises(ConfigError, match="drafter_devices: must be >= 1"):
        resolve_slices(2, 0)
    with pytest.raises(ConfigError, match="both as counts or both as device lists"):
        resolve_slices(2, jax.devices()[2:3])


def test_bytes_per_device_counts_each_devices_own_shards():
    mesh = slice_mesh(jax.devices()[:2])
    split = jax.device_put(np.zeros((4, 6), np.float32), NamedSharding(mesh, P(None, "tensor")))
    whole = jax.device_put(np.zeros((3,), np.float32), NamedSharding(mesh, P()))
    assert bytes_per_device([split, whole]) == 4 * 3 * 4 + 3 * 4


def test_check_disjoint_names_the_overlap():
    devices = jax.devices()
    with pytest.raises(ConfigError, match=r"overlap on devices \[3, 4\]"):
        check_disjoint(devices[:5], devices[3:8])


# ---- logical axes declared on the parameters ------------------------------------------------
def _train_model_config(name: str, devices: int) -> ModelConfig:
    from pathlib import Path

    from d3d_jax.config import TrainRunConfig, load_config

    repo = Path(__file__).resolve().parent.parent
    return load_config(TrainRunConfig, [repo / "configs/train" / f"{name}.yaml"],
                       [f"num_devices={devices}"]).effective_model()


@pytest.mark.parametrize("name,devices", [("tiny", 8), ("d3d-1.7b", 16), ("d3d-8b", 64)])
def test_every_parameter_declares_logical_axes_that_fit_its_shape(name, devices):
    """Every parameter of the shipped configs (abstract: no weights) carries logical axes, one per
    dimension, and each named dimension has the size of the config field it stands for."""
    from d3d_jax.io.hf import stacked_path, tensor_mappings
    from d3d_jax.model.qwen3 import abstract_model
    from d3d_jax.parallel.sharding import logical_axes

    mc = _train_model_config(name, devices)
    model = abstract_model(mc)
    axes = logical_axes(model)  # raises on a parameter without an annotation
    # every parameter the HF layout knows (an independent list of them) is annotated, nothing else;
    # a layer's parameters are stacked on a leading layer axis
    expected = {}
    for m in tensor_mappings(mc):
        path, layer = stacked_path(m.ours)
        expected[tuple(str(k) for k in path)] = ((mc.num_layers,) if layer >= 0 else ()) + m.ours_shape
    assert set(axes) == set(expected)
    sizes = {"embed": {mc.hidden_size}, "heads": {mc.num_heads}, "kv_heads": {mc.num_kv_heads},
             "head_dim": {mc.head_dim}, "mlp": {mc.intermediate_size}, "vocab": {mc.vocab_size},
             "norm": {mc.hidden_size, mc.head_dim}, "layers": {mc.num_layers}}
    for path, names in axes.items():
        assert len(names) == len(expected[path]), path
        for n, size in zip(names, expected[path]):
            assert size in sizes[n], (path, names, expected[path])
    if not mc.tie_word_embeddings:
        assert axes[("lm_head", "kernel")] == ("embed", "vocab")


def test_a_parameter_without_logical_axes_is_an_error():
    from d3d_jax.parallel.sharding import logical_axes, state_shardings, tree_shardings

    class Bare(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((8, 4)))

    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    with pytest.raises(ValueError, match="parameter w has no logical axes"):
        logical_axes(Bare())
    with pytest.raises(ValueError, match="parameter w has no logical axes"):
        shard_model(Bare(), mesh)
    model = init_model(CFG, seed=0)
    # a leaf of a tree that no parameter's path explains is refused, not replicated
    with pytest.raises(ValueError, match="extra: a rank-2 leaf that belongs to no parameter"):
        tree_shardings({"extra": jnp.ones((8, 8))}, logical_axes(model), mesh)
    # optimiser-style trees find their parameter by path; scalars stay replicated
    tree = {"mu": {"layers": {"mlp": {"gate_proj": {"kernel": jnp.ones((2, 32, 64))}}}}, "count": jnp.int32(0)}
    sh = tree_shardings(tree, logical_axes(model), mesh)
    assert sh["mu"]["layers"]["mlp"]["gate_proj"]["kernel"].spec == P(None, "fsdp", "tensor")
    assert sh["count"].spec == P()
    assert state_shardings(nnx.state(model), mesh)["embed_tokens"]["embedding"].get_value().spec == P("tensor", "fsdp")
    with pytest.raises(ValueError, match="logical axis 'embd' has no sharding rule"):
        logical_to_spec(("embd",), (8,), mesh)


def test_the_mesh_is_jax_context_so_jit_sees_it():
    """A function first traced without a mesh is traced again under ``use_mesh`` (JAX's own
    ``jax.set_mesh``), and custom rules reach ``shard`` inside it."""
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    f = jax.jit(lambda x: shard(x * 2, ("batch", "act_vocab")))
    x = jnp.ones((8, 6))
    assert len(f(x).sharding.device_set) == 1
    with use_mesh(mesh):
        assert f(x).sharding.spec == P("fsdp", "tensor")
    with jax.set_mesh(mesh):  # JAX's context alone: the default rules
        assert f(x).sharding.spec == P("fsdp", "tensor")
    g = jax.jit(lambda x: shard(x * 3, ("batch", "act_vocab")))
    with use_mesh(mesh, rules=[("act_vocab", None)]):
        assert g(x).sharding.spec == P("fsdp")  # vocab replicated


def test_saved_layer_inputs_are_split_over_tensor_and_gradients_equal_unsharded():
    """Full remat keeps each layer's input for the backward: on the mesh a tensor-parallel chip
    keeps a sequence slice of it ([layers, rows, length / 2, d]); the gradients stay the same."""
    cfg = dataclasses.replace(CFG, remat_policy="full")
    tokens, meta = packed_inputs(batch=8)

    def grads(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        loss = lambda p, t, mt: jnp.sum(nnx.merge(graphdef, p, rest)(t, mt) ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss)), params

    fn, params = grads(init_model(cfg, seed=2))
    unsharded = jax.tree.leaves(fn(params, tokens, meta))
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    with use_mesh(mesh):
        fn, params = grads(shard_model(init_model(cfg, seed=2), mesh))
        rows = NamedSharding(mesh, logical_to_spec(("batch", "length"), tokens.shape))
        args = jax.tree.map(lambda x: jax.device_put(x, rows), (tokens, meta))
        hlo = fn.lower(params, *args).compile().as_text()
        sharded = jax.tree.leaves(fn(params, *args))
    assert "f32[2,2,11,32]" in hlo and "f32[2,2,22,32]" not in hlo  # the scan's saved inputs
    for a, b in zip(sharded, unsharded):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-5 * max(1.0, np.abs(np.asarray(b)).max())
