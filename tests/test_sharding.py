"""Sharding on 8 simulated CPU devices (conftest): a fsdp 4 × tensor 2 forward equals the
unsharded one; shard() is a no-op without a mesh; the target / drafter device split."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from d3d_jax.config import ConfigError, MeshConfig, ModelConfig
from d3d_jax.model.masks import TokenMeta, packed_training_meta
from d3d_jax.model.qwen3 import init_model
from d3d_jax.parallel.sharding import (batch_sharding, check_disjoint, logical_to_spec, make_mesh,
                                       shard, shard_model, split_devices, use_mesh)

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
    q = model.layers[0].self_attn.q_proj.kernel[...]
    assert q.sharding.spec == P("fsdp", "tensor", None)  # [d, n, h]: d over fsdp, heads over tensor
    assert len({s.device for s in q.addressable_shards}) == 8
    assert model.lm_head.kernel[...].sharding.spec == P("fsdp", "tensor")

    with use_mesh(mesh):
        # a separate jitted function: tracing happens inside the mesh context
        sharded_forward = nnx.jit(lambda m, t, mt: m(t, mt))
        tokens_d = jax.device_put(tokens, batch_sharding(mesh, 2))
        meta_d = jax.tree_util.tree_map(lambda x: jax.device_put(x, batch_sharding(mesh, 2)), meta)
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


def test_split_devices_into_disjoint_target_and_drafter_slices():
    devices = jax.devices()
    target, drafter = split_devices(MeshConfig(target_devices=6, drafter_devices=2))
    assert [d.id for d in target] == [d.id for d in devices[:6]]
    assert [d.id for d in drafter] == [d.id for d in devices[6:]]
    check_disjoint(target, drafter)
    # each slice gets a mesh of its own
    assert dict(make_mesh(MeshConfig(fsdp=-1, tensor=2), target).shape)["fsdp"] == 3
    assert dict(make_mesh(MeshConfig(fsdp=-1), drafter).shape)["fsdp"] == 2
    # 0 / 0: both share every device (the one-device case)
    shared_t, shared_d = split_devices(MeshConfig())
    assert shared_t == shared_d == devices
    check_disjoint(shared_t, shared_d)


def test_split_devices_errors():
    with pytest.raises(ConfigError, match="= 10 but only 8 devices"):
        split_devices(MeshConfig(target_devices=6, drafter_devices=4))
    with pytest.raises(ConfigError, match="set both"):
        split_devices(MeshConfig(target_devices=6))
    devices = jax.devices()
    with pytest.raises(ConfigError, match=r"overlap on devices \[3, 4\]"):
        check_disjoint(devices[:5], devices[3:8])
