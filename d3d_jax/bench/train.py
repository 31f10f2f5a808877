"""``infer/bench.py train``: train-step throughput on a tiny config, and a per-device memory plan.

* **throughput** – builds the synthetic counting corpus, compiles the train step of
  ``--config`` (default ``configs/train/tiny.yaml``) and times ``--steps`` steps after warm-up:
  packed tokens/s and response (loss-carrying block) tokens/s.
* **memory plan** – for ``--plan-config`` (default the D3D-8B drafter) on ``--plan-devices``
  devices of an fsdp mesh, from ``jax.eval_shape`` (no memory is allocated): parameters,
  gradients and optimiser state per device from their shapes, dtypes and shardings, plus an
  activation estimate for one micro-batch (remat checkpoints, the peak layer's attention / MLP
  intermediates, the logits and their gradient).  The attention term follows
  ``model.attention_backend``: ``xla`` materialises ``[b, heads, L, L]`` scores, the fused
  ``pallas`` kernel keeps O(L); ``--plan-attention`` / ``--plan-remat`` plan for another backend
  or remat policy than the config's (e.g. ``pallas`` for a GPU job, planned on a CPU host).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from d3d_jax.config import ATTENTION_BACKENDS, REMAT_POLICIES, TrainRunConfig, load_config, to_dict

REPO = Path(__file__).resolve().parents[2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(REPO / "configs/train/tiny.yaml"), help="config timed for tokens/s")
    p.add_argument("--steps", type=int, default=20, help="timed steps (after compile + 2 warm-up steps)")
    p.add_argument("--devices", type=int, default=1, help="devices for the timed run")
    p.add_argument("--plan-config", default=str(REPO / "configs/train/d3d-8b.yaml"))
    p.add_argument("--plan-devices", type=int, default=64)
    p.add_argument("--plan-batch", type=int, default=0, help="global batch for the plan (default: one row per device)")
    p.add_argument("--plan-attention", default="", choices=("",) + tuple(ATTENTION_BACKENDS),
                   help="attention backend for the plan (default: the config's)")
    p.add_argument("--plan-remat", default="", choices=("",) + REMAT_POLICIES,
                   help="remat policy for the plan (default: the config's)")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("overrides", nargs="*", help="key=value overrides for --config")


# --------------------------------------------------------------------------------------
# Throughput
# --------------------------------------------------------------------------------------
def measure_throughput(config: str, overrides: list[str], steps: int, devices: int) -> dict:
    from d3d_jax.training import data as D
    from d3d_jax.training.loop import Trainer

    tmp = Path(tempfile.mkdtemp(prefix="bench_train_"))
    base = load_config(TrainRunConfig, [config], [f"num_devices={devices}"] + list(overrides))
    vocab = base.model.vocab_size
    D.write_jsonl(tmp / "train.jsonl", D.synthetic_records(64, vocab_size=vocab, seed=0))
    cfg = load_config(TrainRunConfig, [config], [
        f"num_devices={devices}", f"data.train_path={tmp}/train.jsonl", "data.dev_path=''", "data.dev_batches=0",
        f"train.out_dir={tmp}/run", "train.resume=false", "train.progress_bar=false",
        f"train.steps={steps + 2}", "train.checkpoint_every=0", "train.export_params=false",
        "train.export_hf=false"] + list(overrides))
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
    tr.checkpointer.close()
    dc = cfg.data
    block_tokens = float(np.mean([np.sum(b["slot"] >= 1) for b in batches]))
    return {"config": config, "devices": devices, "steps": steps, "seconds": dt,
            "step_ms": 1e3 * dt / steps, "compile_and_first_step_s": compile_s,
            "packed_tokens_per_s": dc.batch_size * dc.packed_length * steps / dt,
            "block_slot_tokens_per_s": block_tokens * steps / dt, "final_loss": float(metrics["loss"])}


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


def memory_plan(config: str, num_devices: int, batch: int = 0, overrides: list[str] = (),
                attention_backend: str = "", remat_policy: str = "") -> dict:
    """Per-device bytes of params / grads / optimiser state (eval_shape) + an activation estimate.

    ``attention_backend`` / ``remat_policy`` plan for a backend or policy this platform need not
    run (the plan is shapes only), e.g. ``pallas`` on a CPU host for a GPU job.
    """
    import dataclasses

    from d3d_jax.model.qwen3 import abstract_model
    from d3d_jax.parallel import sharding as shd
    from d3d_jax.training.loop import _path_names
    from d3d_jax.training.optim import make_optimizer
    from flax import nnx

    batch = batch or num_devices
    cfg = load_config(TrainRunConfig, [config], [
        f"num_devices={num_devices}", "mesh.data=1", f"mesh.fsdp={num_devices}", "mesh.tensor=1",
        f"data.batch_size={batch}", "optim.grad_accum_steps=1"] + list(overrides))
    mc = dataclasses.replace(cfg.effective_model(), block_size=cfg.data.block_size)
    planned = _planned_model(mc, attention_backend, remat_policy)
    mesh = jax.sharding.AbstractMesh((1, num_devices, 1), shd.MESH_AXES)
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

    # Activations of one micro-batch on one device (rows b = batch / (data·fsdp), tensor = 1).
    b = max(batch // num_devices, 1)
    L, V = cfg.data.packed_length, mc.vocab_size
    per_layer = layer_activation_bytes(planned, b, L)
    stored, live = remat_activation_bytes(planned, b, L, per_layer)
    logits = 3 * b * L * V * 4  # float32 logits, softmax, gradient
    activations = stored + live + logits
    grads = p_bytes  # gradients in the parameter dtype, sharded like the parameters
    total = p_bytes + grads + o_bytes + activations
    gib = lambda x: x / 2 ** 30
    return {"config": config, "devices": num_devices, "mesh": f"fsdp {num_devices}", "global_batch": batch,
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


def main(args) -> dict:
    out: dict = {}
    if not args.skip_throughput:
        thr = measure_throughput(args.config, args.overrides, args.steps, args.devices)
        out["throughput"] = thr
        print(f"train step ({Path(args.config).name}, {thr['devices']} device(s)): {thr['step_ms']:.1f} ms/step, "
              f"{thr['packed_tokens_per_s']:.0f} packed tokens/s, {thr['block_slot_tokens_per_s']:.0f} "
              f"block-slot tokens/s (compile + first step {thr['compile_and_first_step_s']:.1f}s)")
    plan = memory_plan(args.plan_config, args.plan_devices, args.plan_batch,
                       attention_backend=args.plan_attention, remat_policy=args.plan_remat)
    out["memory_plan"] = plan
    g = plan["per_device_GiB"]
    print(f"memory plan per device: {Path(args.plan_config).name}, {plan['num_params'] / 1e9:.2f}B params, "
          f"{plan['mesh']}, batch {plan['global_batch']} × {plan['packed_length']} tokens, "
          f"{plan['param_dtype']} master / {plan['compute_dtype']} compute, {plan['optimizer']}, "
          f"remat={plan['remat_policy']}, attention={plan['attention_backend']}")
    for k in ("params", "gradients", "optimizer_state", "activations", "total"):
        print(f"  {k:<16} {g[k]:8.2f} GiB")
    for k, v in g["activations_detail"].items():
        print(f"    {k:<20} {v:8.2f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out
