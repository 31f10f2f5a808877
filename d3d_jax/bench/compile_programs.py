"""The hot programs of decoding and training, built abstractly for a compile-only device.

Each builder returns a :class:`Built`: the jitted function as the decoder or the trainer jits it
(same cores, same donation), abstract arguments (``ShapeDtypeStruct`` with shardings on a
compile-only mesh; nothing is allocated) and the facts the report needs (weight, cache and
embedding-table bytes, rows looked up, a hand count of flops).

A model is built with the ``xla`` backend and then switched by :func:`~d3d_jax.model.qwen3.
set_config`: config validation asks the *host* platform, which is a CPU here, while the program
is compiled for the target device.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    label: str
    config: str  # a configs/models name
    overrides: tuple[str, ...] = ()


@dataclasses.dataclass
class Built:
    fn: Any  # jax.jit(...) with its donation
    args: tuple
    facts: dict
    mesh_context: Callable | None = None  # a context manager the trace must run under


def model_config(spec: ModelSpec, backend: str):
    from d3d_jax.config import load_model_config

    cfg = load_model_config(spec.config, list(spec.overrides) + ["attention_backend=xla"])
    return dataclasses.replace(cfg, attention_backend=backend)


def abstract(spec_or_cfg, backend: str = "xla"):
    """An abstract Qwen3 (no memory) running ``backend``."""
    from d3d_jax.model.qwen3 import abstract_model, set_config

    cfg = model_config(spec_or_cfg, backend) if isinstance(spec_or_cfg, ModelSpec) else spec_or_cfg
    return set_config(abstract_model(dataclasses.replace(cfg, attention_backend="xla")), cfg)


def tree_bytes(tree) -> int:
    return int(sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def on_mesh(tree, mesh):
    """Abstract leaves replicated on ``mesh`` (one device: the decoding programs)."""
    rep = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tree)


def model_facts(model, prefix: str) -> dict:
    cfg = model.config
    table = (jnp.dtype(cfg.param_dtype).name.replace("bfloat16", "bf16").replace("float32", "f32")
             .replace("float16", "f16"), (cfg.vocab_size, cfg.hidden_size))
    return {f"{prefix}_weights_bytes": tree_bytes(nnx.state(model)),
            f"{prefix}_embedding_bytes": cfg.vocab_size * cfg.hidden_size * jnp.dtype(cfg.param_dtype).itemsize,
            f"{prefix}_row_bytes": cfg.hidden_size * jnp.dtype(cfg.param_dtype).itemsize,
            f"{prefix}_layers": cfg.num_layers, "tables": {table}}


def cache_bytes(cfg, cache_len: int, batch: int = 1) -> int:
    return 2 * cfg.num_layers * batch * cache_len * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


# --------------------------------------------------------------------------------------
# Decoding (one device)
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DecodeShape:
    target: ModelSpec
    drafter: ModelSpec
    cache_len: int = 2048
    block_size: int = 16
    positions: int = 12  # C
    fanout: int = 2  # F
    page_size: int = 0  # > 0: paged caches (target and drafter), pages for cache_len tokens

    def paging(self) -> dict:
        """A :class:`~d3d_jax.decoding.core.DecodeCore`'s paging arguments."""
        return dict(page_size=self.page_size, num_pages=-(-self.cache_len // self.page_size)) if self.page_size else {}

    @property
    def layout(self):
        from d3d_jax.decoding.branches import BranchLayout

        return BranchLayout(self.block_size, self.positions, self.fanout)


def _target(shape: DecodeShape, backend: str):
    from d3d_jax.model.qwen3 import unstacked

    model = unstacked(abstract(shape.target, backend))  # as a decoder runs it
    facts = model_facts(model, "target")
    facts["target_cache_bytes"] = cache_bytes(model.config, shape.cache_len)
    return model, facts


def _drafter(spec: ModelSpec, backend: str, shape: DecodeShape):
    from d3d_jax.decoding.drafting import ModelDrafter
    from d3d_jax.model.qwen3 import unstacked

    model = unstacked(abstract(spec, backend))  # one module per layer, as every command loads a drafter
    facts = model_facts(model, "drafter")
    facts["drafter_cache_bytes"] = cache_bytes(model.config, shape.cache_len)
    return ModelDrafter(model), facts


def _merge(*facts: dict) -> dict:
    out: dict = {"tables": set()}
    for f in facts:
        out.update({k: v for k, v in f.items() if k != "tables"})
        out["tables"] |= f["tables"]
    return out


def plain_step(shape: DecodeShape, backend: str, mesh) -> Built:
    """One plain round (1 token: verify of no drafts, commit) of the target, state donated."""
    from d3d_jax.decoding.core import DecodeCore

    model, facts = _target(shape, backend)
    gd, params = nnx.split(model)
    core = DecodeCore(gd, model.config, None, width=1, cache_len=shape.cache_len, **shape.paging())
    state = jax.eval_shape(lambda: core.init_state(1))
    fn = jax.jit(lambda p, s: core.round(p, None, s), donate_argnums=1)
    return Built(fn, (on_mesh(params, mesh), on_mesh(state, mesh)), {**facts, "rows": 1})


def under_mesh(built: Built, mesh) -> Built:
    """``built`` traced under ``mesh``: the fused kernels lower for its devices (a TPU's Mosaic
    kernels rather than the GPU's), split by ``shard_map`` over its axes."""
    from d3d_jax.parallel import sharding as shd

    return dataclasses.replace(built, mesh_context=lambda: shd.use_mesh(mesh))


def verify_round(shape: DecodeShape, backend: str, mesh) -> Built:
    """The async round's target side: verify and commit of a handed-over B-token block."""
    from d3d_jax.decoding.async_core import AsyncCore
    from d3d_jax.decoding.core import DecodeCore

    model, facts = _target(shape, backend)
    drafter, _ = _drafter(shape.drafter, backend, shape)
    gd, params = nnx.split(model)
    core = DecodeCore(gd, model.config, None, width=shape.block_size, cache_len=shape.cache_len,
                      **shape.paging())
    acore = AsyncCore(core, drafter, shape.layout)
    state = jax.eval_shape(lambda: core.init_state(1))
    hand = jax.ShapeDtypeStruct((1, shape.block_size + 1), jnp.int32)
    fn = jax.jit(acore.target_step, donate_argnums=1)
    args = (on_mesh(params, mesh), on_mesh(state, mesh), on_mesh(hand, mesh))
    return Built(fn, args, {**facts, "rows": shape.block_size})


def sync_round(shape: DecodeShape, backend: str, mesh) -> Built:
    """One sync round: the drafter's block forward, the target's verify, commit."""
    from d3d_jax.decoding.core import DecodeCore

    model, tfacts = _target(shape, backend)
    drafter, dfacts = _drafter(shape.drafter, backend, shape)
    gd, params = nnx.split(model)
    core = DecodeCore(gd, model.config, drafter, width=shape.block_size, cache_len=shape.cache_len,
                      **shape.paging())
    state = jax.eval_shape(lambda: core.init_state(1))
    fn = jax.jit(core.round, donate_argnums=2)
    args = (on_mesh(params, mesh), on_mesh(drafter.params, mesh), on_mesh(state, mesh))
    return Built(fn, args, {**_merge(tfacts, dfacts), "rows": shape.block_size})


def _async_drafter_side(shape: DecodeShape, spec: ModelSpec, backend: str):
    from d3d_jax.decoding.async_core import AsyncCore
    from d3d_jax.decoding.core import DecodeCore

    drafter, facts = _drafter(spec, backend, shape)
    core = DecodeCore(None, None, None, width=shape.block_size, cache_len=shape.cache_len)
    acore = AsyncCore(core, drafter, shape.layout)
    side = jax.eval_shape(lambda: acore.init_state(1))
    return drafter, acore, side, facts


def branch_pack(shape: DecodeShape, backend: str, mesh, spec: ModelSpec | None = None) -> Built:
    """The async round's drafter side, first dispatch: the packed forward of every branch."""
    drafter, acore, side, facts = _async_drafter_side(shape, spec or shape.drafter, backend)
    fn = jax.jit(acore.packed, donate_argnums=1)
    return Built(fn, (on_mesh(drafter.params, mesh), on_mesh(side, mesh)),
                 {**facts, "rows": shape.layout.budget})


def select_step(shape: DecodeShape, backend: str, mesh) -> Built:
    """The async round's drafter side, second dispatch: hit/miss and (on a miss) a sync draft."""
    drafter, acore, side, facts = _async_drafter_side(shape, shape.drafter, backend)
    drafts = jax.eval_shape(acore.packed, drafter.params, side)[0]
    decision = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    fn = jax.jit(acore.select, donate_argnums=1)
    args = tuple(on_mesh(x, mesh) for x in (drafter.params, side, drafts, decision))
    return Built(fn, args, {**facts, "rows": shape.block_size})


def split_shardings(tree, mesh, params: bool):
    """The decoder's placement on a slice (:func:`~d3d_jax.parallel.sharding.placer`) for abstract
    leaves: parameters by their logical axes, a state replicated but its KV cache over KV heads."""
    from d3d_jax.parallel.sharding import slice_shardings

    shardings = slice_shardings(tree, mesh, params=params)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                        shardings)


def split_target_step(shape: DecodeShape, backend: str, mesh, rows: int, width: int) -> Built:
    """One round of the target alone over a tensor-parallel slice (``mesh``: its devices on a
    ``tensor`` axis): ``width`` 1 is the plain step, ``shape.block_size`` the async round's verify
    and commit; ``rows`` sequences of ``shape.cache_len`` tokens, the state donated."""
    from d3d_jax.decoding.async_core import AsyncCore
    from d3d_jax.decoding.core import DecodeCore

    model, facts = _target(shape, backend)
    gd, params = nnx.split(model)
    core = DecodeCore(gd, model.config, None, width=width, cache_len=shape.cache_len, **shape.paging())
    state = split_shardings(jax.eval_shape(lambda: core.init_state(rows)), mesh, params=False)
    params = split_shardings(params, mesh, params=True)
    keep = jax.tree.map(lambda x: x.sharding, state)
    if width == 1:
        fn = jax.jit(lambda p, s: core.round(p, None, s), donate_argnums=1, out_shardings=(keep, None))
        args = (params, state)
    else:
        drafter, _ = _drafter(shape.drafter, backend, shape)
        acore = AsyncCore(core, drafter, shape.layout)
        hand = split_shardings(jax.ShapeDtypeStruct((rows, shape.block_size + 1), jnp.int32), mesh, False)
        fn = jax.jit(acore.target_step, donate_argnums=1, out_shardings=(keep, None, None))
        args = (params, state, hand)
    facts.update(target_cache_bytes=cache_bytes(model.config, shape.cache_len, rows), rows=rows * width,
                 target_param_bytes_per_device=per_device_bytes(params, mesh))
    return Built(fn, args, facts)


def per_device_bytes(tree, mesh) -> int:
    """The bytes of ``tree``'s abstract leaves that one device holds (its shards)."""
    return int(sum(int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """One training pack through the fused kernels alone (the D3D-8B drafter's heads)."""

    length: int = 6144
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"


def flash_kernels(shape: KernelShape, mesh, platform: str = "gpu") -> Built:
    """Forward and backward of the fused kernels (``d3d_flash_fwd``, ``_dq``, ``_dkv``) over a
    causal pack: the PTX facts of all three come from one compile (``platform="tpu"``: the
    Mosaic kernels; trace under ``jax.set_mesh(mesh)``, Mosaic asks it which TPU it is)."""
    from d3d_jax.model.flash_attention import flash_attention
    from d3d_jax.model.masks import causal_meta

    def loss(q, k, v, pos):
        out, _ = flash_attention(q, k, v, causal_meta(pos), causal_meta(pos), platform=platform)
        return jnp.sum(out.astype(jnp.float32))

    t, dt = shape.length, jnp.dtype(shape.dtype)
    q = jax.ShapeDtypeStruct((1, t, shape.heads, shape.head_dim), dt)
    kv = jax.ShapeDtypeStruct((1, t, shape.kv_heads, shape.head_dim), dt)
    pos = jax.ShapeDtypeStruct((1, t), jnp.int32)
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return Built(fn, on_mesh((q, kv, kv, pos), mesh), {"rows": t, "tables": set()})


# --------------------------------------------------------------------------------------
# Training (a mesh of many devices)
# --------------------------------------------------------------------------------------
def train_config(config: str, chips: int, overrides: tuple[str, ...] = ()):
    """The run config on ``chips`` devices with its own mesh and batch (validated as ``xla``: the
    host is a CPU); returns ``(cfg, model config with the requested backend)``."""
    from d3d_jax.config import TrainRunConfig, load_config

    wanted = [o for o in overrides if o.startswith("model.attention_backend=")]
    rest = [o for o in overrides if o not in wanted]
    cfg = load_config(TrainRunConfig, [config], [f"num_devices={chips}", *rest])
    mc = cfg.effective_model()
    backend = wanted[-1].split("=", 1)[1] if wanted else mc.attention_backend
    mc = dataclasses.replace(mc, attention_backend=backend, block_size=cfg.data.block_size,
                             mask_token_id=mc.mask_token_id if mc.mask_token_id is not None else 1)
    return cfg, mc


def batch_spec(cfg) -> dict:
    """Abstract ``[accum, micro, ...]`` batch of the D3D data pipeline's keys and dtypes."""
    dc, accum = cfg.data, cfg.optim.grad_accum_steps
    rows = (accum, dc.batch_size // accum)
    per_token = dict(tokens=jnp.int32, labels=jnp.int32, ar_mask=bool, slot=jnp.int32, positions=jnp.int32,
                     block_ids=jnp.int32, context_end=jnp.int32, valid=bool)
    spec = {k: jax.ShapeDtypeStruct(rows + (dc.packed_length,), dt) for k, dt in per_token.items()}
    spec.update(anchors=jax.ShapeDtypeStruct(rows + (dc.num_anchors,), jnp.int32),
                anchor_valid=jax.ShapeDtypeStruct(rows + (dc.num_anchors,), bool))
    return spec


def train_step(config: str, mesh, overrides: tuple[str, ...] = ()) -> Built:
    """The trainer's step (``training.step.train_step``) with its shardings and donation."""
    from d3d_jax.parallel import sharding as shd
    from d3d_jax.training import objectives as obj
    from d3d_jax.training.step import batch_shardings, train_step as step_fn
    from d3d_jax.training.optim import lr_schedule, make_optimizer

    cfg, mc = train_config(config, mesh.devices.size, overrides)
    model = abstract(mc)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    state = jax.eval_shape(lambda p, r: dict(params=p, rest=r, opt_state=tx.init(p),
                                             step=jnp.zeros([], jnp.int32)),
                           nnx.as_pure(params), nnx.as_pure(rest))
    state_sh = shd.tree_shardings(state, shd.logical_axes(model), mesh, cfg.mesh.rules)
    batch = batch_spec(cfg)
    b_sh = batch_shardings(batch, mesh, cfg.mesh.rules)
    fn = partial(step_fn, graphdef, tx, obj.make_loss_fn(cfg.objective),
                 lr_schedule(cfg.optim, cfg.train.steps), partial(obj.loss_totals, gamma=cfg.objective.gamma))
    jitted = jax.jit(fn, in_shardings=(state_sh, b_sh, None), out_shardings=(state_sh, None),
                     donate_argnums=(0,))
    put = lambda tree, shs: jax.tree.map(  # noqa: E731
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shs)
    facts = {**model_facts(model, "model"), "rows": cfg.data.batch_size * cfg.data.packed_length,
             "hand_flops": train_hand_flops(mc, cfg.data.batch_size, cfg.data.packed_length),
             "mesh": dict(zip(mesh.axis_names, mesh.devices.shape)), "global_batch": cfg.data.batch_size,
             "packed_length": cfg.data.packed_length, "remat": mc.layer_remat,
             "plan_GiB": _plan_gib(config, mesh.devices.size, overrides, mc.attention_backend),
             "config_layers": _config_layers(config, mesh.devices.size, overrides)}
    return Built(jitted, (put(state, state_sh), put(batch, b_sh), None), facts,
                 mesh_context=lambda: shd.use_mesh(mesh, cfg.mesh.rules))


def _config_layers(config: str, chips: int, overrides) -> int:
    """The run config's own depth (a reduced-depth compile extrapolates to it)."""
    rest = tuple(o for o in overrides if not o.startswith("model.num_layers="))
    return train_config(config, chips, rest)[1].num_layers


def _plan_gib(config: str, chips: int, overrides, backend: str) -> float:
    """``infer/bench.py train``'s memory plan of the same config, mesh and batch (GiB/device)."""
    from d3d_jax.bench.train import memory_plan

    rest = [o for o in overrides if not o.startswith("model.attention_backend=")]
    return memory_plan(config, chips, overrides=rest, attention_backend=backend)["per_device_GiB"]["total"]


# How many times a layer's forward runs in a step, per remat policy: (weight matmuls, attention
# with the xla backend, attention with the fused kernel).  ``full`` recomputes the whole layer in
# the backward; the ``save_dots*`` policies keep matmul outputs (``save_dots``: the xla scores
# too); ``save_attention`` keeps the fused kernel's output, so only its forward is spared.
_FORWARD_RUNS = {"none": (1, 1, 1), "full": (2, 2, 2), "save_dots": (1, 1, 2),
                 "save_dots_no_batch": (1, 2, 2), "save_attention": (2, 2, 1)}
# Attention flops of a backward per (query, key, head-dim) triple: dense, dP = dO·Vᵀ, dV = PᵀdO,
# dQ = dS·K, dK = dSᵀQ (8); the fused kernels recompute QKᵀ (and dP) in each of dQ (6) and
# dK/dV (8) instead of keeping the scores.
_ATTENTION_BACKWARD = {"xla": 8, "pallas": 6 + 8}


def train_hand_flops(mc, rows: int, length: int) -> dict:
    """Flops of one step by hand, as the program computes them: every weight matmul (2 per MAC)
    forward, again per forward recomputed under the remat policy (the LM head is not
    rematerialised), backward twice the forward; attention dense over ``L²`` (QKᵀ and PV:
    ``4·L²·N·H`` per layer and row forward), which is what the ``xla`` backend and the kernels'
    estimates both count, with the fused kernels' backward recomputing the scores (14 per
    triple against the dense 8)."""
    D, F, V, N, K, H = (mc.hidden_size, mc.intermediate_size, mc.vocab_size, mc.num_heads,
                        mc.num_kv_heads, mc.head_dim)
    fused = mc.attention_backend.startswith("pallas")
    weight_runs, xla_runs, fused_runs = _FORWARD_RUNS[mc.layer_remat]
    tokens = rows * length
    per_layer = D * (N + 2 * K) * H + N * H * D + 3 * D * F
    layers = (weight_runs + 2) * 2 * per_layer * mc.num_layers * tokens
    head = 3 * 2 * D * V * tokens
    per_triple = 4 * (fused_runs if fused else xla_runs) + _ATTENTION_BACKWARD["pallas" if fused else "xla"]
    attention = per_triple * length * length * N * H * mc.num_layers * rows
    return {"layers": float(layers), "lm_head": float(head), "attention_dense": float(attention),
            "total": float(layers + head + attention)}
