"""``infer/bench.py train``: measured train-step throughput, MFU and peak memory against the plan.

``infer/bench.py train --model d3d-drafter-1.7b`` (or ``--model tiny`` on CPU, or ``--config``)
compiles the train step of that model's training config on ``--devices`` devices (an fsdp mesh,
``--batch`` rows, default one per device) with a synthetic counting corpus whose responses fill
the clean stream, times ``--steps`` steps after warm-up and reports:

* **tokens/s** – packed tokens (every position of every row) and loss-carrying block slots;
* **MFU** – model FLOPs per step over (step time × peak).  Model FLOPs are ``6·N·T`` (``N``: the
  matmul parameters, i.e. all but the embedding table, plus the LM head, tied or not; ``T``:
  packed tokens) plus attention ``12·layers·heads·head_dim`` per (query, key) pair *the §2.3
  mask allows* (counted from the batch), i.e. what the model needs, not the dense ``L²`` the XLA
  path computes (printed too).  Peak: ``--peak-tflops`` (per device), else a table by
  ``device_kind`` (dense bf16); on CPU a measured matmul of the compute dtype on one device
  (simulated CPU devices share the host's cores, so the peak is not multiplied by them);
* **peak memory** – ``device.memory_stats()["peak_bytes_in_use"]`` (max over devices; CPU: n/a)
  next to the per-device :func:`memory_plan` (``jax.eval_shape``, nothing allocated) of the same
  shape, mesh and batch.

On CPU a model above ``CPU_MAX_PARAMS`` is not run (it would take minutes per step and more host
memory than a workstation has): the plan and the FLOPs per step are printed, with a line saying so.
``--plan-config`` adds a second plan on that config's own mesh and batch (D3D-8B: 64 devices as
data 1 × fsdp 16 × tensor 4, batch 16); ``--plan-devices/--plan-batch`` change its size.

The memory plan's attention term follows ``model.attention_backend``: ``xla`` materialises
``[b, heads, L, L]`` scores, the fused ``pallas`` kernel keeps O(L); ``--plan-attention`` /
``--plan-remat`` plan every printed plan for another backend or remat policy than the config's
(e.g. ``pallas`` for a GPU job, planned on a CPU host; shapes only, nothing runs).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from d3d_jax.config import ATTENTION_BACKENDS, REMAT_POLICIES, TrainRunConfig, load_config

REPO = Path(__file__).resolve().parents[2]
MODELS = {"tiny": "configs/train/tiny.yaml", "d3d-drafter-1.7b": "configs/train/d3d-1.7b.yaml",
          "d3d-drafter-8b": "configs/train/d3d-8b.yaml"}
CPU_MAX_PARAMS = 200_000_000
# Dense bf16 TFLOP/s per JAX device, by a substring of device_kind (most specific first).  TPU v2/v3
# expose each of a chip's two cores as a device.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0), ("B200", 2250.0),
                    ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0), ("TPU v6 lite", 918.0), ("TPU v6e", 918.0),
                    ("TPU v5 lite", 197.0), ("TPU v5e", 197.0), ("TPU v5p", 459.0), ("TPU v5", 459.0),
                    ("TPU v4", 275.0), ("TPU v3", 61.5), ("TPU v2", 22.5))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", choices=sorted(MODELS), help="which training config to time")
    p.add_argument("--config", default="", help="a training config instead of --model's")
    p.add_argument("--steps", type=int, default=20, help="timed steps (after compile + 2 warm-up steps)")
    p.add_argument("--devices", type=int, default=0, help="devices for the timed run (0: all)")
    p.add_argument("--batch", type=int, default=0, help="global rows per step (default: one per device)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="peak TFLOP/s per device (overrides the table)")
    p.add_argument("--plan-config", default="", help="also plan this config (e.g. configs/train/d3d-8b.yaml)")
    p.add_argument("--plan-devices", type=int, default=0,
                   help="devices for --plan-config (default: its mesh's size; 64 where an axis is -1)")
    p.add_argument("--plan-batch", type=int, default=0,
                   help="global batch for --plan-config (default: its data.batch_size)")
    p.add_argument("--skip-throughput", action="store_true", help="print the plan only")
    p.add_argument("--plan-attention", default="", choices=("",) + tuple(ATTENTION_BACKENDS),
                   help="attention backend for the plans (default: the config's)")
    p.add_argument("--plan-remat", default="", choices=("",) + REMAT_POLICIES,
                   help="remat policy for the plans (default: the config's)")
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("overrides", nargs="*", help="key=value overrides for the timed config")


# --------------------------------------------------------------------------------------
# FLOPs and peaks
# --------------------------------------------------------------------------------------
def attended_pairs(batch: dict) -> int:
    """(query, key) pairs the packed rows' mask allows (:func:`d3d_jax.model.masks.attention_mask`'s
    rule, counted per row in O(L log L) instead of building ``[L, L]``)."""
    from d3d_jax.model.masks import CAUSAL

    total = 0
    for pos, bid, ce, ok in zip(batch["positions"], batch["block_ids"], batch["context_end"], batch["valid"]):
        causal = np.sort(pos[ok & (bid == CAUSAL)])
        total += int(np.searchsorted(causal, ce[ok], side="left").sum())  # causal keys with pos < context_end
        _, sizes = np.unique(bid[ok & (bid != CAUSAL)], return_counts=True)
        total += int((sizes.astype(np.int64) ** 2).sum())  # each block sees all of itself
    return total


def step_flops(mc, batch: dict) -> dict:
    """Model FLOPs of one train step (forward + backward) on ``batch`` (host arrays ``[rows, L]``)."""
    rows, L = np.shape(batch["tokens"])
    D, F, V, H, hd, K = (mc.hidden_size, mc.intermediate_size, mc.vocab_size, mc.num_heads, mc.head_dim,
                         mc.num_kv_heads)
    per_layer = D * (H + 2 * K) * hd + H * hd * D + 3 * D * F
    matmul_params = mc.num_layers * per_layer + D * V  # the LM head multiplies, tied or not
    tokens = rows * L
    per_pair = 12 * mc.num_layers * H * hd  # QKᵀ and PV, 2 FLOPs a MAC, backward twice the forward
    pairs = attended_pairs(batch)
    return {"matmul_params": matmul_params, "tokens": tokens, "attended_pairs": pairs,
            "dense_pairs": rows * L * L, "linear": 6.0 * matmul_params * tokens, "attention": float(per_pair * pairs),
            "attention_dense": float(per_pair * rows * L * L), "total": 6.0 * matmul_params * tokens + per_pair * pairs}


def cpu_matmul_peak(dtype: str, n: int = 1024, reps: int = 8) -> float:
    """FLOP/s of the best of ``reps`` ``n×n`` matmuls in ``dtype`` on one CPU device."""
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.dtype(dtype))
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        mm(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def peak_flops(device, dtype: str, override_tflops: float = 0.0) -> tuple[float | None, str]:
    """Peak FLOP/s of one device and where the number comes from."""
    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    if device.platform == "cpu":
        return cpu_matmul_peak(dtype), f"measured {dtype} 1024² matmul on one CPU device"
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device.device_kind.lower():
            return tflops * 1e12, f"dense bf16 peak of {device.device_kind}"
    return None, f"unknown device kind {device.device_kind!r}: pass --peak-tflops"


def peak_memory_bytes(devices) -> int | None:
    stats = [d.memory_stats() for d in devices]
    peaks = [s.get("peak_bytes_in_use") for s in stats if s]
    return max(peaks) if peaks and None not in peaks else None


# --------------------------------------------------------------------------------------
# Throughput
# --------------------------------------------------------------------------------------
def bench_config(config: str, devices: int, batch: int, overrides: list[str], workdir: Path) -> TrainRunConfig:
    """The timed run's config: ``config`` on an fsdp mesh of ``devices``, random init, a synthetic
    corpus written to ``workdir`` whose responses fill the clean stream."""
    from d3d_jax.training import data as D

    mesh = fsdp_mesh(devices)
    base = load_config(TrainRunConfig, [config], [f"num_devices={devices}", f"data.batch_size={batch}"] + mesh
                       + list(overrides))
    prompt = 4
    D.write_jsonl(workdir / "train.jsonl", D.synthetic_records(
        max(16, base.data.batch_size), vocab_size=base.model.vocab_size, prompt_len=prompt,
        response_len=base.data.clean_length - prompt, seed=0))
    return load_config(TrainRunConfig, [config], [
        f"num_devices={devices}", f"data.batch_size={batch}", *mesh, f"data.train_path={workdir}/train.jsonl",
        "data.dev_path=''", "data.dev_batches=0", "data.tokenizer=''", f"train.out_dir={workdir}/run",
        "train.init_from=''", "train.resume=false", "train.progress_bar=false", "train.steps=1000000",
        "train.checkpoint_every=0", "train.export_params=false", "train.export_hf=false"] + list(overrides))


def measure_throughput(cfg: TrainRunConfig, steps: int) -> dict:
    """Compile, 2 warm-up steps, then ``steps`` timed steps (host batches prepared beforehand)."""
    from d3d_jax.training.loop import Trainer

    tr = Trainer(cfg, log=lambda s: print("  " + s))
    t0 = time.time()
    tr.train_step(next(tr.train_iter))
    compile_s = time.time() - t0
    jax.block_until_ready(tr.train_step(next(tr.train_iter)))
    batches = [next(tr.train_iter) for _ in range(steps)]  # host data time is not the step's
    t0 = time.time()
    metrics = None
    for b in batches:
        metrics = tr.train_step(b)
    jax.block_until_ready(metrics)
    dt = time.time() - t0
    devices = list(tr.mesh.devices.flat)
    tr.checkpointer.close()
    dc = cfg.data
    return {"devices": len(devices), "device_kind": devices[0].device_kind, "steps": steps, "seconds": dt,
            "step_s": dt / steps, "compile_and_first_step_s": compile_s,
            "packed_tokens_per_s": dc.batch_size * dc.packed_length * steps / dt,
            "block_slot_tokens_per_s": float(np.mean([np.sum(b["slot"] >= 1) for b in batches])) * steps / dt,
            "final_loss": float(metrics["loss"]), "peak_memory_bytes": peak_memory_bytes(devices),
            "batch": batches[0]}


# --------------------------------------------------------------------------------------
# Memory plan
# --------------------------------------------------------------------------------------
def _shard_bytes(tree, shardings_fn) -> int:
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        spec = shardings_fn(path, leaf.shape)
        n = int(np.prod(leaf.shape)) if leaf.shape else 1
        div = 1
        for entry, mesh_size in spec:
            div *= mesh_size
        total += (n // max(div, 1)) * np.dtype(leaf.dtype).itemsize
    return total


def attention_activation_bytes(mc, b: int, L: int) -> dict:
    """Bytes one layer's attention keeps for its backward, by backend, plus its dot outputs."""
    N, K, H = mc.num_heads, mc.num_kv_heads, mc.head_dim
    act = np.dtype(mc.dtype).itemsize
    qkv_out = b * L * (2 * N + 2 * K) * H * act
    if mc.attention_backend in ("pallas", "pallas_interpret"):
        # O(L): q, k, v, output, log-sum-exp and delta, float32 dq and per-head dk/dv in the backward
        return {"total": qkv_out + 2 * b * N * L * 4 + 3 * b * L * N * H * 4, "batch_dots": 0}
    if mc.attention_backend == "cudnn":  # fused softmax, but a dense [b, L, L] mask / bias
        return {"total": qkv_out + b * L * L * (act + 1) + b * N * L * 4, "batch_dots": 0}
    scores = b * N * L * L * 4  # float32 scores and probs in the compute dtype, plus the bool mask
    return {"total": qkv_out + b * N * L * L * (4 + act) + b * L * L, "batch_dots": scores + b * L * N * H * act}


def layer_activation_bytes(mc, b: int, L: int) -> dict:
    D, F, N, K, H = mc.hidden_size, mc.intermediate_size, mc.num_heads, mc.num_kv_heads, mc.head_dim
    act = np.dtype(mc.dtype).itemsize
    attn = attention_activation_bytes(mc, b, L)
    weight_dots = b * L * ((N + 2 * K) * H + 2 * D + 2 * F) * act  # q/k/v/o projections, MLP
    return {"attention": attn["total"], "total": attn["total"] + 3 * b * L * F * act + 4 * b * L * D * act,
            "weight_dots": weight_dots, "batch_dots": attn["batch_dots"],
            "flash_outputs": b * L * N * H * act + b * N * L * 4 if attn["batch_dots"] == 0 else 0}


def remat_activation_bytes(mc, b: int, L: int, per_layer: dict) -> tuple[int, int]:
    """``(stored for the backward, live while one layer is differentiated)`` under the remat policy."""
    policy, n = mc.layer_remat, mc.num_layers
    if policy == "none":
        return n * per_layer["total"], per_layer["total"]
    inputs = n * b * L * mc.hidden_size * np.dtype(mc.dtype).itemsize  # each layer's input
    saved = {"full": 0, "save_attention": per_layer["flash_outputs"],
             "save_dots_no_batch": per_layer["weight_dots"],
             "save_dots": per_layer["weight_dots"] + per_layer["batch_dots"]}[policy]
    return inputs + n * saved, 2 * per_layer["total"]  # one layer recomputed and differentiated


def _planned_model(mc, attention_backend: str, remat_policy: str):
    """``mc`` with the planned backend / remat policy (activations follow them, parameters do not).

    Not validated against this platform: a CPU host may plan a GPU job's ``pallas``.
    """
    import dataclasses

    from d3d_jax.config import ConfigError

    if attention_backend and attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"--plan-attention: unknown backend {attention_backend!r} (known: "
                          f"{', '.join(ATTENTION_BACKENDS)})")
    if remat_policy and remat_policy not in REMAT_POLICIES:
        raise ConfigError(f"--plan-remat: unknown policy {remat_policy!r} (known: {', '.join(REMAT_POLICIES)})")
    if attention_backend:
        mc = dataclasses.replace(mc, attention_backend=attention_backend)
    if remat_policy:
        mc = dataclasses.replace(mc, remat_policy=remat_policy, gradient_checkpointing=False)
    return mc


def fsdp_mesh(devices: int) -> list[str]:
    """Overrides for an fsdp mesh over ``devices`` (the timed run's mesh)."""
    return ["mesh.data=1", f"mesh.fsdp={devices}", "mesh.tensor=1"]


def _per_device_model(mc, tensor: int):
    """``mc`` with the dims the tensor axis splits (heads, MLP, vocabulary) divided by it, where
    it divides them (as the sharding rules do): the activation formulas then count one device."""
    import dataclasses

    split = {k: getattr(mc, k) // tensor for k in ("num_heads", "num_kv_heads", "intermediate_size",
                                                   "vocab_size") if getattr(mc, k) % tensor == 0}
    return dataclasses.replace(mc, **split) if tensor > 1 else mc


def _yaml_mesh(config: str, overrides) -> list[int]:
    """``[data, fsdp, tensor]`` as the config (and its ``mesh.*`` overrides) state them (-1: all
    remaining devices), read before any device count is known."""
    from d3d_jax.config import MeshConfig
    from d3d_jax.config.base import parse_overrides, read_yaml

    mesh = read_yaml(config).get("mesh", {})
    mesh = read_yaml(mesh) if isinstance(mesh, str) else dict(mesh)
    mesh.update(parse_overrides(overrides).get("mesh", {}))
    return [int(mesh.get(k, getattr(MeshConfig(), k))) for k in ("data", "fsdp", "tensor")]


def memory_plan(config: str, num_devices: int = 0, batch: int = 0, overrides: list[str] = (),
                attention_backend: str = "", remat_policy: str = "") -> dict:
    """Per-device bytes of params / grads / optimiser state (eval_shape) + an activation estimate,
    on the config's own mesh and batch (``overrides`` may change them, e.g. :func:`fsdp_mesh`).

    ``num_devices`` 0: the mesh's own size (64 where a mesh axis is -1); ``batch`` 0: the
    config's ``data.batch_size``.  ``attention_backend`` / ``remat_policy`` plan for a backend or
    policy this platform need not run (the plan is shapes only), e.g. ``pallas`` on a CPU host.
    """
    import dataclasses

    from d3d_jax.model.qwen3 import abstract_model
    from d3d_jax.parallel import sharding as shd
    from d3d_jax.training.loop import _path_names
    from d3d_jax.training.optim import make_optimizer
    from flax import nnx

    fixed = _yaml_mesh(config, overrides)
    num_devices = num_devices or (int(np.prod(fixed)) if min(fixed) > 0 else 64)
    cfg = load_config(TrainRunConfig, [config], [f"num_devices={num_devices}"]
                      + ([f"data.batch_size={batch}"] if batch else []) + list(overrides))
    batch = cfg.data.batch_size
    mc = dataclasses.replace(cfg.effective_model(), block_size=cfg.data.block_size)
    planned = _planned_model(mc, attention_backend, remat_policy)
    sizes = cfg.mesh.axis_sizes(num_devices)
    mesh = jax.sharding.AbstractMesh(tuple(sizes), shd.MESH_AXES)
    rules = shd.rules_dict(cfg.mesh.rules)

    def spec_sizes(path, shape):
        names = _path_names(path)
        for i in range(len(names) - 2, -1, -1):
            axes = shd.PARAM_AXES.get((names[i], names[i + 1]))
            if axes is not None and len(axes) == len(shape):
                spec = shd.logical_to_spec(axes, shape, mesh, rules)
                out = []
                for e in spec:
                    ax = () if e is None else ((e,) if isinstance(e, str) else tuple(e))
                    out.append((ax, int(np.prod([mesh.shape[a] for a in ax])) if ax else 1))
                return out
        return []

    params = nnx.as_pure(nnx.state(abstract_model(mc), nnx.Param))
    opt_state = jax.eval_shape(make_optimizer(cfg.optim, cfg.train.steps).init, params)
    p_bytes = _shard_bytes(params, spec_sizes)
    o_bytes = _shard_bytes(opt_state, spec_sizes)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))

    # Activations of one micro-batch on one device: rows b = micro-batch / (data·fsdp), and the
    # heads, MLP and vocabulary the tensor axis splits.
    b = max(batch // cfg.optim.grad_accum_steps // (sizes[0] * sizes[1]), 1)
    one = _per_device_model(planned, sizes[2])
    L, V = cfg.data.packed_length, one.vocab_size
    per_layer = layer_activation_bytes(one, b, L)
    stored, live = remat_activation_bytes(one, b, L, per_layer)
    logits = 3 * b * L * V * 4  # float32 logits, softmax, gradient
    activations = stored + live + logits
    grads = p_bytes  # gradients in the parameter dtype, sharded like the parameters
    total = p_bytes + grads + o_bytes + activations
    gib = lambda x: x / 2 ** 30
    return {"config": config, "devices": num_devices, "global_batch": batch,
            "mesh": " × ".join(f"{a} {n}" for a, n in zip(shd.MESH_AXES, sizes)),
            "rows_per_device": b, "packed_length": L, "num_params": n_params, "param_dtype": mc.param_dtype,
            "compute_dtype": mc.dtype, "optimizer": cfg.optim.name,
            "gradient_checkpointing": planned.gradient_checkpointing, "remat_policy": planned.layer_remat,
            "attention_backend": planned.attention_backend,
            "per_device_GiB": {"params": gib(p_bytes), "gradients": gib(grads), "optimizer_state": gib(o_bytes),
                               "activations": gib(activations), "activations_detail": {
                                   "stored_for_backward": gib(stored), "live_layer": gib(live),
                                   "attention_per_layer": gib(per_layer["attention"]),
                                   "logits": gib(logits)}, "total": gib(total)},
            "optimizer_state_total_GiB": gib(o_bytes * num_devices),
            "params_total_GiB": gib(p_bytes * num_devices)}


def _one_batch(cfg: TrainRunConfig) -> dict:
    """A host batch of the timed config without building the model (for the FLOPs of a skipped run)."""
    from d3d_jax.training import data as D

    mask = D.resolve_mask_token_id(cfg.data, cfg.model.mask_token_id, None)
    return D.build_dataset(cfg.data, cfg.data.train_path, mask_token_id=mask)[0][0]


def run_bench(config: str, devices: int, batch: int, steps: int, overrides: list[str], *,
              peak_tflops: float = 0.0, skip_throughput: bool = False, plan_attention: str = "",
              plan_remat: str = "") -> dict:
    """Plan, FLOPs and (unless skipped) the timed run with MFU and peak memory; see the module doc."""
    cfg = bench_config(config, devices, batch, overrides, Path(tempfile.mkdtemp(prefix="bench_train_")))
    mc = cfg.effective_model()
    plan = memory_plan(config, devices, batch, overrides=fsdp_mesh(devices) + list(overrides),
                       attention_backend=plan_attention,
                       remat_policy=plan_remat)
    out: dict = {"config": config, "devices": devices, "global_batch": batch, "packed_length": cfg.data.packed_length,
                 "compute_dtype": mc.dtype, "num_params": plan["num_params"], "plan": plan}
    device = jax.devices()[0]
    if skip_throughput:
        out["skipped"] = "--skip-throughput"
    elif device.platform == "cpu" and plan["num_params"] > CPU_MAX_PARAMS:
        host_gib = _host_memory_gib()
        need = plan["per_device_GiB"]["total"] * devices
        out["skipped"] = (f"not run on CPU: {plan['num_params'] / 1e9:.2f}B parameters "
                          f"(> {CPU_MAX_PARAMS / 1e6:.0f}M): a step takes minutes and the plan needs {need:.1f} GiB "
                          f"(host: {host_gib:.1f} GiB); run it on a GPU or TPU")
    if "skipped" in out:
        out["flops"] = step_flops(mc, _one_batch(cfg))
        return out
    thr = measure_throughput(cfg, steps)
    out["flops"] = flops = step_flops(mc, thr.pop("batch"))
    peak, source = peak_flops(device, mc.dtype, peak_tflops)
    # simulated CPU devices share one host's cores: its peak is one device's, not devices × that
    n_peak = 1 if device.platform == "cpu" else thr["devices"]
    thr.update(peak_flops_per_device=peak, peak_source=source,
               mfu=None if peak is None else flops["total"] / thr["step_s"] / (peak * n_peak),
               plan_total_bytes=plan["per_device_GiB"]["total"] * 2 ** 30)
    thr["peak_memory_over_plan"] = (None if thr["peak_memory_bytes"] is None
                                    else thr["peak_memory_bytes"] / thr["plan_total_bytes"])
    out["throughput"] = thr
    return out


def _host_memory_gib() -> float:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def print_result(r: dict) -> None:
    f = r["flops"]
    n = r["num_params"]
    params = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    print(f"train step: {Path(r['config']).name}, {params} params, {r['devices']} device(s) "
          f"(fsdp), batch {r['global_batch']} × {r['packed_length']} tokens, {r['compute_dtype']} compute")
    print(f"  model FLOPs/step    {_si(f['total'], 'FLOP'):>12} = 6·N·T {_si(f['linear'], 'FLOP')} + attention "
          f"{_si(f['attention'], 'FLOP')} ({f['attended_pairs'] / f['dense_pairs']:.1%} of the L² pairs; "
          f"dense: {_si(f['attention_dense'], 'FLOP')})")
    if "skipped" in r:
        print(f"  throughput: {r['skipped']}")
        return
    t = r["throughput"]
    print(f"  step time           {1e3 * t['step_s']:9.1f} ms   ({t['steps']} steps; compile + first step "
          f"{t['compile_and_first_step_s']:.1f} s; final loss {t['final_loss']:.4f})")
    tps = t["packed_tokens_per_s"]
    print(f"  tokens/s            {tps:12.0f} packed ({tps / t['devices']:.0f} per device), "
          f"{t['block_slot_tokens_per_s']:.0f} block-slot")
    mfu = "n/a" if t["mfu"] is None else f"{100 * t['mfu']:.1f} %"
    peak = "" if t["peak_flops_per_device"] is None else f"{t['peak_flops_per_device'] / 1e12:.2f} TFLOP/s, "
    print(f"  MFU                 {mfu:>12} (peak {peak}{t['peak_source']})")
    plan_gib = t["plan_total_bytes"] / 2 ** 30
    if t["peak_memory_bytes"] is None:
        print(f"  peak memory         {'n/a':>12} ({t['device_kind']} reports no memory_stats); "
              f"plan {plan_gib:.2f} GiB/device")
    else:
        print(f"  peak memory         {t['peak_memory_bytes'] / 2 ** 30:8.2f} GiB per device; plan {plan_gib:.2f} GiB "
              f"(measured / plan {t['peak_memory_over_plan']:.2f})")


def print_plan(plan: dict) -> None:
    g = plan["per_device_GiB"]
    print(f"memory plan per device: {Path(plan['config']).name}, {plan['num_params'] / 1e9:.2f}B params, "
          f"{plan['mesh']}, batch {plan['global_batch']} × {plan['packed_length']} tokens, "
          f"{plan['param_dtype']} master / {plan['compute_dtype']} compute, {plan['optimizer']}, "
          f"remat={plan['remat_policy']}, attention={plan['attention_backend']}")
    for k in ("params", "gradients", "optimizer_state", "activations", "total"):
        print(f"  {k:<16} {g[k]:8.2f} GiB")
    for k, v in g["activations_detail"].items():
        print(f"    {k:<20} {v:8.2f} GiB")


def main(args) -> dict:
    config = args.config or str(REPO / MODELS[args.model])
    devices = args.devices or jax.device_count()
    out = run_bench(config, devices, args.batch or devices, args.steps, args.overrides,
                    peak_tflops=args.peak_tflops, skip_throughput=args.skip_throughput,
                    plan_attention=args.plan_attention, plan_remat=args.plan_remat)
    print_result(out)
    print_plan(out["plan"])
    if args.plan_config:
        out["extra_plan"] = memory_plan(args.plan_config, args.plan_devices, args.plan_batch,
                                        attention_backend=args.plan_attention, remat_policy=args.plan_remat)
        print_plan(out["extra_plan"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=float))
    return out
