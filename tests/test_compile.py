"""Deviceless compiles (``d3d_jax/bench/compile*``): the kernels and the decoding and training
programs compiled for an H200 and a TPU topology on this CPU, with small shapes.

The real compilers run (XLA's GPU pipeline, Triton and ptxas; libtpu and Mosaic), so a kernel
the hardware cannot take fails here: a 256 x 256 float32 tile exceeds the H200's shared memory,
a 48-wide tile is not a power of two.  Figures are checked against closed forms: a matmul's flops
and bytes, the launch grid of the kernel, the bytes of an embedding lookup, the branch rule of
the cost analysis.  Skipped (with the reason) where the CUDA plugin, ptxas or libtpu is missing:
``pip install -e '.[test]'`` brings them (``make test`` does).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from d3d_jax.bench import compile_facts as cf
from d3d_jax.bench import compile_report
from d3d_jax.bench import compile_programs as cp
from d3d_jax.bench import compile_targets as ct

TINY = cp.ModelSpec("tiny", "tiny", ("num_layers=2",))
TINY_DRAFTER = cp.ModelSpec("tiny-drafter", "tiny-drafter", ("mask_token_id=4095",))
SHAPE = cp.DecodeShape(TINY, TINY_DRAFTER, cache_len=1024, positions=4)


def _need(name: str) -> None:
    why = ct.available(name)
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def h200():
    _need("h200")
    topo = ct.topology(ct.device("h200"))
    return ct.mesh(topo, (1,), ("x",))


# Test-only options for the H200 compiles (``infer/bench.py compile`` keeps XLA's, so the compile
# seconds it reports stay a real compile's).  ptxas at -O0: the registers and spills the tests
# check come from a separate ``ptxas -v`` of the dumped PTX (``cf.ptxas_report``), not from it.
FAST = {"xla_gpu_disable_gpuasm_optimizations": True}


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    """XLA's GPU kernel cache, shared by the file's compiles whose PTX is not read (most of an H200
    compile is ~110 ptxas runs, one a kernel; the tiny models' programs share most kernels).  A
    kernel taken from it is not written to ``xla_dump_to``, so tests that read the dump go without."""
    path = tmp_path_factory.mktemp("gpu_kernels") / "cache"
    return {"xla_gpu_kernel_cache_file": str(path), "xla_gpu_enable_llvm_module_compilation_parallelism": True,
            **FAST}


def _compile(fn, args, mesh, tmp_path, **options):
    args = cp.on_mesh(args, mesh)
    return fn.trace(*args).lower().compile(compiler_options={"xla_dump_to": str(tmp_path), **FAST, **options})


def _compile_dumped(built, tmp_path):
    """A built H200 program compiled with its PTX dumped to ``tmp_path`` (no kernel cache: a
    cached kernel is not dumped)."""
    return built.fn.trace(*built.args).lower().compile(compiler_options={"xla_dump_to": str(tmp_path), **FAST})


# --------------------------------------------------------------------------------------
# H200: what the figures are made of, against closed forms
# --------------------------------------------------------------------------------------
def test_memory_and_cost_are_the_closed_forms(h200, tmp_path, kernel_cache):
    m, k, n = 256, 512, 128
    a, b = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    c = _compile(jax.jit(lambda x, y: x @ y), (a, b), h200, tmp_path, **kernel_cache)
    mem, cost = cf.memory(c), cf.xla_cost(c)
    assert mem["argument"] == 2 * (m * k + k * n) and mem["output"] == 2 * m * n
    # the gemm, plus a few flops per output element of its epilogue (its bytes depend on the
    # tiling XLA picks without autotuning: not a closed form)
    assert 2 * m * k * n <= cost["flops"] <= 2 * m * k * n + 16 * m * n
    c = _compile(jax.jit(lambda x, y: x * 2 + y), (a, a), h200, tmp_path / "ew", **kernel_cache)
    cost = cf.xla_cost(c)
    assert cost["flops"] == 2 * m * k and cost["bytes"] == 3 * 2 * m * k  # two reads, one write


def test_the_private_cost_call_exists_and_agrees_with_the_public_one():
    # compile-only executables get their cost from jaxlib's private hlo_module_cost_analysis
    # (their public cost_analysis() is None): a jax upgrade that moves it fails here, by name
    f = jax.jit(lambda a, b: jnp.tanh(a @ b).sum())
    c = f.lower(jnp.ones((64, 128)), jnp.ones((128, 32))).compile()
    public, private = c.cost_analysis(), cf._module_cost(c)
    for key in ("flops", "transcendentals", "bytes accessed"):
        assert private[key] == public[key] > 0, key
    assert private["flops"] >= 2 * 64 * 128 * 32 and private["transcendentals"] == 64 * 32


def test_embedding_lookup_overcount_is_the_table_minus_its_rows(h200, tmp_path, kernel_cache):
    v, d, rows = 8192, 256, 16
    table = jax.ShapeDtypeStruct((v, d), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, rows), jnp.int32)
    c = _compile(jax.jit(lambda t, i: jnp.take(t, i, axis=0)), (table, ids), h200, tmp_path, **kernel_cache)
    charged = cf.xla_cost(c)["bytes"]
    extras, _ = cf.walk(c.as_text(), {("bf16", (v, d))})
    assert charged >= 2 * v * d  # the whole table, for 16 rows
    assert extras.lookup_overcount == 2 * v * d - 2 * rows * d
    assert charged - extras.lookup_overcount == 2 * rows * d * 2 + 4 * rows  # rows read + written, ids


def test_walk_takes_the_largest_branch_per_figure():
    """The HLO walk mirrors XLA's cost analysis: a conditional costs its largest branch."""
    hlo = """HloModule m

%small (p: f32[1]) -> f32[1] {
  %p = f32[1]{0} parameter(0)
  %k1 = (bf16[1,16,4,64]{3,2,1,0}, f32[1,4,16]{2,1,0}) custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", operand_layout_constraints={s32[1,1,2]{2,1,0}, s32[1,1]{1,0}, bf16[1,16,4,64]{3,2,1,0}, bf16[1,128,2,64]{3,2,1,0}, bf16[1,128,2,64]{3,2,1,0}, s32[1,16]{1,0}, s32[1,16]{1,0}, s32[1,128]{1,0}, s32[1,128]{1,0}}, api_version=API_VERSION_TYPED_FFI, backend_config={grid_x = 1 : i32, grid_y = 4 : i32, grid_z = 1 : i32, name = "d3d_flash_fwd"}
}

%large (p: f32[1]) -> f32[1] {
  %p = f32[1]{0} parameter(0)
  %k2 = (bf16[1,16,4,64]{3,2,1,0}, f32[1,4,16]{2,1,0}) custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", operand_layout_constraints={s32[1,1,8]{2,1,0}, s32[1,1]{1,0}, bf16[1,16,4,64]{3,2,1,0}, bf16[1,512,2,64]{3,2,1,0}, bf16[1,512,2,64]{3,2,1,0}, s32[1,16]{1,0}, s32[1,16]{1,0}, s32[1,512]{1,0}, s32[1,512]{1,0}}, api_version=API_VERSION_TYPED_FFI, backend_config={grid_x = 1 : i32, grid_y = 4 : i32, grid_z = 1 : i32, name = "d3d_flash_fwd"}
}

ENTRY %main (i: s32[], p: f32[1]) -> f32[1] {
  %i = s32[] parameter(0)
  %p = f32[1]{0} parameter(1)
  ROOT %c = f32[1]{0} conditional(%i, %p, %p), branch_computations={%small, %large}
}
"""
    extras, calls = cf.walk(hlo)
    assert len(calls) == 2 and all(c["in_branch"] for c in calls)
    # operands: the live-tile list and count, q, k, v, the queries' and the keys' metadata
    lists, q, meta, out = 4 * 8 + 4, 16 * 4 * 64 * 2, 2 * 16 * 4 + 2 * 512 * 4, 16 * 4 * 64 * 2 + 4 * 16 * 4
    assert extras.kernel_bytes == lists + q + 2 * 512 * 2 * 64 * 2 + meta + out  # the 512-key branch, not the sum
    assert extras.kernel_flops == 4 * 4 * 16 * 512 * 64  # 4 flops per (query, key, head dim), 4 heads


def _raw_forward(q_len, s_len, dtype, tiles):
    """The forward kernel called with the given tiles as they are (``flash_attention`` would cap
    and round them to what fits)."""
    from d3d_jax.model import flash_attention as fa
    from d3d_jax.model import flash_kernels as fk
    from d3d_jax.model.masks import causal_meta

    bq, bk = tiles

    def f(q, k, v, qpos, kpos):
        qctx, qbid = fa.encode_queries(causal_meta(qpos))
        kp, kb = fa.encode_keys(causal_meta(kpos))
        lists = fa.live_tiles(fa.tile_visibility(causal_meta(qpos), causal_meta(kpos), bq, bk))
        return fk.gpu_forward(q, k, v, qctx, qbid, kp, kb, *lists, bq=bq, bk=bk, out_dtype=q.dtype,
                              interpret=False)

    n, kh, h = 8, 2, 64
    args = (jax.ShapeDtypeStruct((1, q_len, n, h), dtype), jax.ShapeDtypeStruct((1, s_len, kh, h), dtype),
            jax.ShapeDtypeStruct((1, s_len, kh, h), dtype), jax.ShapeDtypeStruct((1, q_len), jnp.int32),
            jax.ShapeDtypeStruct((1, s_len), jnp.int32))
    return jax.jit(f), args


def test_flash_kernel_compiles_with_its_grid_and_ptx_facts(h200, tmp_path):
    fn, args = _raw_forward(256, 512, jnp.bfloat16, (64, 64))
    c = _compile(fn, args, h200, tmp_path)
    (k,) = cf.gpu_kernels(tmp_path, ("d3d_flash",))
    assert k["symbol"] == "d3d_flash_fwd" and k["target"].startswith("sm_90")
    assert k["grid"] == [1, 8, 256 // 64] and k["ctas"] == 32  # (row, query head, query tile)
    assert k["registers"] > 0 and k["spill_stores"] == 0 and k["mma_sync"] + k["wgmma"] > 0
    _, calls = cf.walk(c.as_text())
    (call,) = calls
    assert call["flops"] == 4 * 8 * 256 * 512 * 64


@pytest.mark.parametrize("dtype,tiles,error", [
    (jnp.float32, (256, 256), "Shared memory size limit exceeded"),
    (jnp.bfloat16, (48, 64), "power of 2"),
])
def test_a_tile_the_h200_cannot_take_fails_to_compile(h200, tmp_path, dtype, tiles, error):
    fn, args = _raw_forward(512, 512, dtype, tiles)
    with pytest.raises(Exception, match=error):
        _compile(fn, args, h200, tmp_path)


# --------------------------------------------------------------------------------------
# H200: the PTX bars of the kernels (pipelined loads, wgmma, no spills, CTAs for decode)
# --------------------------------------------------------------------------------------
SMALL_PACK = cp.KernelShape(length=256, heads=8, kv_heads=2)


def _failed(checks):
    return [(c["check"], c["value"]) for c in checks if not c["met"]]


def test_training_kernels_pipeline_their_loads_without_spills(h200, tmp_path):
    """fwd, dq, dkv: cp.async > 0 (loop bounds, no branch around the loads), wgmma in the
    forward (64-row bf16 tiles), 0 spill bytes, each from its own PTX entry."""
    built = cp.flash_kernels(SMALL_PACK, h200)
    _compile_dumped(built, tmp_path)
    kernels = cf.gpu_kernels(tmp_path, ("d3d_flash",))
    assert {k["symbol"] for k in kernels} == {"d3d_flash_fwd", "d3d_flash_dq", "d3d_flash_dkv"}
    assert _failed(compile_report.ptx_checks(kernels, "pack", training=True)) == []


def _cond_around_loads(tiles_ref, count_ref, q_ref, k_ref, v_ref, qctx_ref, qbid_ref, kpos_ref, kbid_ref,
                       o_ref, lse_ref, *, bk, s_len):
    """The forward as it was before the live-tile lists: every tile visited, a ``cond`` around
    its loads (so Triton cannot prefetch them)."""
    from jax import lax

    from d3d_jax.model import flash_kernels as fk

    q, qctx, qbid, count = q_ref[...], qctx_ref[...], qbid_ref[...], count_ref[...]

    def body(j, carry):
        def step(c):
            k, v, kpos, kbid = fk._key_tile((k_ref, v_ref, kpos_ref, kbid_ref), tiles_ref[j] * bk, bk, s_len)
            return fk.fwd_step(c, q, k, v, fk.visible(qctx, qbid, kpos, kbid))
        return lax.cond(j < count, step, lambda c: c, carry)

    out, lse = fk.fwd_finish(lax.fori_loop(0, tiles_ref.shape[0], body, fk.fwd_init(*q.shape)))
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse.reshape(lse.shape[0])


def test_a_kernel_with_a_branch_around_its_loads_fails_the_ptx_check(h200, tmp_path, monkeypatch):
    from d3d_jax.model import flash_kernels as fk

    monkeypatch.setattr(fk, "gpu_fwd_kernel", _cond_around_loads)
    built = cp.flash_kernels(SMALL_PACK, h200)
    _compile_dumped(built, tmp_path)
    failed = _failed(compile_report.ptx_checks(cf.gpu_kernels(tmp_path, ("d3d_flash",)), "broken", training=True))
    assert ("broken: d3d_flash_fwd async_copies", 0) in failed  # the backward kernels still pass
    assert all(name.startswith("broken: d3d_flash_fwd") for name, _ in failed)


def test_decode_and_verify_fill_the_h200_at_8b_heads(h200, tmp_path):
    """Batch 1, Qwen3-8B's heads (32 over 8, head 128) over one layer of a 2048-slot cache read
    in place: the key splits give every one of the 132 SMs a CTA, for 1 and for 16 queries."""
    from d3d_jax.model.flash_attention import flash_decode_cache
    from d3d_jax.model.masks import causal_meta

    def f(q1, q16, k, v, kpos):
        outs = []
        for q in (q1, q16):
            qpos = 2048 - q.shape[1] + jnp.arange(q.shape[1])[None]
            outs.append(flash_decode_cache(q, k, v, 0, causal_meta(qpos), causal_meta(kpos), platform="gpu")[0])
        return outs

    bf = jnp.bfloat16
    cache = jax.ShapeDtypeStruct((2, 1, 2048, 8, 128), bf)
    args = (jax.ShapeDtypeStruct((1, 1, 32, 128), bf), jax.ShapeDtypeStruct((1, 16, 32, 128), bf), cache, cache,
            jax.ShapeDtypeStruct((1, 2048), jnp.int32))
    _compile(jax.jit(f), args, h200, tmp_path)
    runs = cf.launches(tmp_path, ("d3d_flash_decode",))
    assert len(runs) == 2 and all(r["ctas"] >= 132 for r in runs), runs
    kernels = cf.gpu_kernels(tmp_path, ("d3d_flash",))
    assert _failed(compile_report.ptx_checks(kernels, "decode", min_ctas=132)) == []


# --------------------------------------------------------------------------------------
# H200: the decoding programs, tiny shapes, with the kernel
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("build", [cp.plain_step, cp.verify_round, cp.branch_pack],
                         ids=lambda f: f.__name__)
def test_decoding_programs_compile_for_h200_with_the_kernel(h200, tmp_path, build):
    built = build(SHAPE, "pallas", h200)
    c = _compile_dumped(built, tmp_path)
    cache = built.facts.get("target_cache_bytes", built.facts.get("drafter_cache_bytes"))
    assert cf.memory(c)["alias"] >= cache  # the donated cache is updated in place
    kernels = cf.gpu_kernels(tmp_path, ("d3d_flash",))
    # ptxas's figures are read for every kernel (today's float32 tiles spill at these shapes: the
    # 0-spill bar is for the new kernels, at the bench's bf16 shapes)
    assert kernels and all(isinstance(k["spill_stores"], int) and k["registers"] > 0 for k in kernels)
    assert sum(k["launches"] for k in kernels) >= 2 * 2  # 2 layers x (cache span, new keys)


def test_xla_plain_step_does_not_copy_the_cache(h200, kernel_cache):
    """A dot over the cache span made XLA copy every layer's span into [b, k, s, h] first: temp
    memory grew with the cache (311 MB at Qwen3-8B, cache 2048).  It must not grow now."""
    temps, caches = [], []
    for n in (256, 1024):
        built = cp.plain_step(dataclasses.replace(SHAPE, cache_len=n), "xla", h200)
        c = built.fn.trace(*built.args).lower().compile(compiler_options=kernel_cache)
        temps.append(cf.memory(c)["temp"])
        caches.append(built.facts["target_cache_bytes"])
    assert temps[1] - temps[0] < (caches[1] - caches[0]) / 4


@pytest.mark.parametrize("width", [1, 16])
def test_a_target_over_two_h200s_holds_half_its_weights_and_cache_per_device(kernel_cache, width):
    """The plain step and the verify round with the target tensor-parallel over 2 compile-only
    H200s: each device's arguments are half the weights (the norms whole) and half the KV cache,
    counted from the config."""
    _need("h200")
    from d3d_jax.parallel.sharding import MESH_AXES

    mesh = ct.mesh(ct.topology(ct.device("2xh200")), (1, 1, 2), MESH_AXES)
    rows, cfg = 2, cp.model_config(TINY, "xla")
    built = cp.split_target_step(SHAPE, "xla", mesh, rows, width)
    c = built.fn.trace(*built.args).lower().compile(compiler_options=kernel_cache)
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    split = v * d + cfg.num_layers * (2 * d * q + 2 * d * kv + 3 * d * f)  # tied embeddings
    whole = cfg.num_layers * (2 * d + 2 * cfg.head_dim) + d  # RMSNorm scales, q/k norms, final norm
    weights = 4 * (split // 2 + whole)  # float32
    cache = 2 * cfg.num_layers * rows * SHAPE.cache_len * kv * 4 // 2
    assert built.facts["target_param_bytes_per_device"] == weights
    arguments = cf.memory(c)["argument"]
    assert weights + cache <= arguments < weights + cache + 64 * 1024  # + the small per-row state


# --------------------------------------------------------------------------------------
# TPU: the train step on a v5e-8 topology
# --------------------------------------------------------------------------------------
def test_train_step_compiles_for_tpu_and_counts_the_hand_flops(tmp_path):
    _need("tpu-v5e-8")
    from d3d_jax.config.base import CONFIG_DIR
    from d3d_jax.parallel.sharding import MESH_AXES

    dev = ct.device("tpu-v5e-8")
    config = str(CONFIG_DIR / "train/tiny.yaml")
    # rows of 32 clean tokens and two 16-token anchor blocks: libtpu's compile took 15 s of CPU
    # against 30 s at the config's 192 (64 + 8 x 16); XLA's flops stay within 2 % of the hand count
    overrides = ("model.num_layers=1", "model.hidden_size=256", "model.intermediate_size=1024",
                 "model.head_dim=64", "model.vocab_size=1024", "data.batch_size=8", "data.num_anchors=2",
                 "data.packed_length=64")
    cfg, _ = cp.train_config(config, dev.chips, overrides)
    mesh = ct.mesh(ct.topology(dev), cfg.mesh.axis_sizes(dev.chips), MESH_AXES)
    built = cp.train_step(config, mesh, overrides)
    options = {"xla_dump_to": str(tmp_path), **dict(
        (("xla_tpu_enable_windowed_einsum_for_all_gather", False),
         ("xla_tpu_enable_windowed_einsum_for_reduce_scatter", False)))}
    with built.mesh_context():
        c = built.fn.trace(*built.args).lower().compile(compiler_options=options)
    mem = cf.memory(c)
    params = 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(built.args[0]["params"]))
    assert params / dev.chips <= mem["argument"]  # float32 master weights, sharded over 8 chips
    # libtpu reports its own peak (the bench shows it beside the sum of the parts); it holds
    # the arguments
    assert mem["compiler_peak"] >= mem["argument"] > 0
    hand = built.facts["hand_flops"]["total"] / dev.chips
    assert abs(cf.xla_cost(c)["flops"] / hand - 1) < 0.10


def test_the_kernel_lowers_for_the_active_meshs_platform():
    """Inside a TPU mesh (a compile-only one included) ``pallas`` means the Mosaic kernels."""
    _need("tpu-v5e-8")
    from d3d_jax.model.attention import kernel_platform

    topo = ct.topology(ct.device("tpu-v5e-8"))
    with jax.set_mesh(jax.sharding.Mesh(np.asarray(topo.devices[:1]), ("x",))):
        assert kernel_platform("pallas") == "tpu"
    assert kernel_platform("pallas") == "gpu"  # no mesh: the host (a CPU here) is not a TPU


def test_fused_kernel_compiles_for_tpu_as_mosaic_calls(tmp_path):
    """The same kernel source lowers for a TPU: forward, dQ and dK/dV are Mosaic kernels
    (``tpu_custom_call``) in the compiled v5e program."""
    _need("tpu-v5e-8")
    topo = ct.topology(ct.device("tpu-v5e-8"))
    # one chip: a Mosaic kernel is not partitioned automatically (the model shard_maps it)
    mesh = jax.sharding.Mesh(np.asarray(topo.devices[:1]), ("x",))
    shape = cp.KernelShape(length=1024, heads=4, kv_heads=2)
    built = cp.flash_kernels(shape, mesh, platform="tpu")
    with jax.set_mesh(mesh):
        c = built.fn.trace(*built.args).lower().compile()
    assert cf.tpu_custom_calls(c.as_text()) == 3
    # each Mosaic call is found by name and estimated: 4 + 6 + 8 flops per (query, key, dim)
    extras, calls = cf.walk(c.as_text())
    assert sorted(k["name"] for k in calls if k["estimated"]) == ["d3d_flash_dkv", "d3d_flash_dq", "d3d_flash_fwd"]
    assert extras.kernel_flops == 18 * shape.heads * shape.length ** 2 * shape.head_dim


# --------------------------------------------------------------------------------------
# The pod step's report: reduced depths extrapolated along a line (no compile)
# --------------------------------------------------------------------------------------
def _pod_row(backend: str, layers: int, gib: float, tflop: float = 0.0, hand_tflop: float = 0.0) -> dict:
    name = "D3D-8B train step" + (", flops" if tflop else "") + f", {layers} layers"
    return {"program": name, "backend": backend, "kind": "train", "compiled": True, "chips": 64,
            "memory": {"peak": gib * 2 ** 30}, "flops": tflop * 1e12,
            "roofline": {"flops_s": tflop * 1e12 / 459e12},
            "ideal": {"flops_over_hand": tflop / hand_tflop if hand_tflop else 0.0},
            "facts": {"model_layers": layers, "config_layers": 36,
                      "hand_flops": {"total": hand_tflop * 64e12}}}


def test_pod_step_depths_extrapolate_along_their_line_and_meet_the_bar_there():
    # memory 1.5 + 0.25·L GiB: 10.5 GiB at 36 layers (0.634 of 16.55, over the bar); hand count
    # 4 + 3·L TFLOP per chip, XLA 2 % under it
    rows = [_pod_row("pallas", d, 1.5 + 0.25 * d) for d in (2, 4, 8)]
    rows += [_pod_row("pallas", d, 0, 0.98 * (4 + 3 * d), 4 + 3 * d) for d in (2, 4)]
    line = compile_report.depth_line(rows[:3], lambda r: r["memory"]["peak"] / 2 ** 30)
    assert line["per_layer"] == pytest.approx(0.25) and line["intercept"] == pytest.approx(1.5)
    assert line["at_full"] == pytest.approx(10.5) and line["max_residual"] == pytest.approx(0, abs=1e-9)
    bent = compile_report.depth_line(rows[:2] + [_pod_row("pallas", 8, 1.5 + 0.25 * 8 + 0.3)],
                                     lambda r: r["memory"]["peak"] / 2 ** 30)
    assert bent["max_residual"] > 0.05  # three depths show a bend; two never could
    got = {c["check"]: c for c in compile_report.train_checks(rows)}
    memory = next(c for k, c in got.items() if "GiB per chip / 16.55" in k)
    assert "extrapolated from 2, 4, 8" in memory["check"] and memory["met"] is False
    assert memory["value"] == pytest.approx(10.5 / 16.55)
    floor = next(c for k, c in got.items() if "step-time floor" in k)
    assert floor["value"] == pytest.approx(0.98 * (4 + 3 * 36) * 1e12 / 459e12)
    assert all(c["met"] for k, c in got.items() if "hand count" in k)
