"""``infer/bench.py compile --platform h200|tpu-v5p-128|tpu-v5e-8``: every hot program compiled for
a device that is not there, on a CPU host (``JAX_PLATFORMS=cpu``).

Programs (full shapes; ``--small`` gives 2-layer models and a 256-slot cache, as the suite uses):

* ``h200``: the fused kernels alone, forward and backward over a 6144-token pack with the 8B
  drafter's heads (the PTX facts of ``d3d_flash_fwd``, ``_dq`` and ``_dkv``); the Qwen3-8B
  target and the D3D-1.7B drafter on one H200, cache 2048, batch 1, B = 16, C = 12, F = 2: the
  plain step, the async round's target side (verify + commit of a 16-token block), the sync round, the async drafter side (branch pack of N_async = 384 tokens,
  and the selection); the branch pack of the drafter-size table's 4B and 31-layer 8B drafters;
  the D3D-1.7B train step on 8 x H200 (``configs/train/d3d-1.7b.yaml``'s mesh and batch);
  with ``--target-devices N``, the plain step and the async verify round of ``--split-target``
  (Qwen3-32B) tensor-parallel over N H200s, ``--split-rows`` x ``--cache-len``;
* ``tpu-v5p-128`` (64 chips): the D3D-8B train step with its own mesh (1 x 16 x 4, batch 16 x
  6144), once as XLA compiles it (memory) and once with windowed-einsum collectives off (flops:
  the cost analysis counts a ``while`` body once, and those collective matmuls are loops), with
  each ``--train-backend`` side by side and at each ``--train-layers`` depth (the report draws a
  line through the depths to the config's; memory is not linear in depth, so it is a quick look);
* ``tpu-v5e-8``: the D3D-1.7B train step on 8 v5e chips.

Per program (:mod:`~d3d_jax.bench.compile_facts`): compiled or the compiler's error; memory per
device against HBM; XLA's flops and bytes, the embedding-lookup correction and each kernel's own
estimate (:mod:`~d3d_jax.bench.kernel_cost`); the roofline ``max(flops / peak, bytes /
bandwidth)``; the ideal (decode: weights + cache; training: the hand count of flops); per GPU
kernel the PTX facts.  Writes ``bench_compile.json`` after every program and ``bench_compile.md``
(:mod:`~d3d_jax.bench.compile_report`).  Estimates, not timings: see the README.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

from d3d_jax.bench import compile_facts as cf
from d3d_jax.bench import compile_programs as cp
from d3d_jax.bench import compile_targets as ct
from d3d_jax.bench import kernel_cost
from d3d_jax.model import kv_cache as kvc

DEFAULT_OUT = "runs/bench_compile"
TARGET = cp.ModelSpec("Qwen3-8B", "qwen3-8b")
DRAFTERS = (cp.ModelSpec("1.7B", "d3d-drafter-1.7b"), cp.ModelSpec("4B", "qwen3-4b", ("mask_token_id=151669",)),
            cp.ModelSpec("8B, 31 layers", "d3d-drafter-8b", ("num_layers=31",)))
_SMALL = ("num_layers=2",)
NO_WINDOWED_EINSUM = (("xla_tpu_enable_windowed_einsum_for_all_gather", False),
                      ("xla_tpu_enable_windowed_einsum_for_reduce_scatter", False))
KERNEL_PREFIXES = ("d3d_flash",)


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    device: str  # a compile_targets.DEVICES key
    backend: str
    build: Callable  # mesh -> Built
    kind: str  # "kernels" | "decode" | "pack" | "train"
    options: tuple = ()  # XLA compiler options (name, value)
    mesh_shape: Callable | None = None  # chips -> (sizes, axes); default: one flat axis


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--platform", default="h200", choices=("h200", "tpu-v5p-128", "tpu-v5e-8", "all"))
    p.add_argument("--backends", default="xla,pallas",
                   help="attention backends of the decoding programs (comma-separated); the plain step "
                        "and the verify round get each, the rest the last one")
    p.add_argument("--train-backend", default="xla",
                   help="attention backend(s) of the train steps (comma-separated): the pod step's memory "
                        "is compiled with each, side by side; its flops and the other train steps with the last")
    p.add_argument("--only", default="", help="run only programs whose name contains one of these "
                   "comma-separated texts (=NAME: that name exactly)")
    p.add_argument("--train-layers", type=_depths, default=(0,),
                   help="layers of the train steps' models, comma-separated depths (0: the config's); a "
                        "pod step at full depth takes 15-25 min on 2 cores: with two depths or more the "
                        "report extrapolates its memory and flops to the config's depth along a line")
    p.add_argument("--small", action="store_true", help="2-layer models, cache 256 (the suite's shapes)")
    p.add_argument("--cache-len", type=int, default=2048)
    p.add_argument("--kv-page-size", type=int, default=0,
                   help="> 0: also the plain step, verify and sync round over paged KV caches of "
                        "pages this long (named '..., paged N'; on tpu-v5e-8 the plain step and verify)")
    p.add_argument("--target-devices", type=int, default=0,
                   help="> 1: also the plain step and the async verify round of --split-target over that "
                        "many H200s (tensor parallel, KV cache split over KV heads), --split-rows sequences "
                        "of --cache-len tokens (named '..., over N devices')")
    p.add_argument("--split-target", default="qwen3-32b", help="the target model of --target-devices")
    p.add_argument("--split-rows", type=int, default=16, help="sequences of the --target-devices programs")
    p.add_argument("--keep-dumps", action="store_true", help="keep the XLA dumps under OUT/dumps")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for bench_compile.json and .md")
    return p


def _depths(text: str) -> tuple[int, ...]:
    try:
        depths = tuple(sorted({int(d) for d in text.split(",") if d.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--train-layers: comma-separated integers, got {text!r}") from None
    if not depths or min(depths) < 0:
        raise argparse.ArgumentTypeError(f"--train-layers: depths >= 0 (0: the config's), got {text!r}")
    return depths


# --------------------------------------------------------------------------------------
# The programs of each platform
# --------------------------------------------------------------------------------------
def _spec(spec: cp.ModelSpec, small: bool) -> cp.ModelSpec:
    return dataclasses.replace(spec, overrides=spec.overrides + (_SMALL if small else ()))


def decode_programs(backends: list[str], small: bool, cache_len: int, page_size: int = 0) -> list[Program]:
    shape = cp.DecodeShape(_spec(TARGET, small), _spec(DRAFTERS[0], small), cache_len=cache_len)
    last = backends[-1]
    out = []
    for b in backends:
        out += [Program("plain step", "h200", b, lambda m, b=b: cp.plain_step(shape, b, m), "decode"),
                Program("verify round (async target side)", "h200", b,
                        lambda m, b=b: cp.verify_round(shape, b, m), "decode")]
    out += [Program("sync round", "h200", last, lambda m: cp.sync_round(shape, last, m), "decode"),
            Program("async select (drafter side)", "h200", last, lambda m: cp.select_step(shape, last, m),
                    "decode")]
    for d in DRAFTERS:
        out.append(Program(f"branch pack, {d.label} drafter", "h200", last,
                           lambda m, d=d: cp.branch_pack(shape, last, m, _spec(d, small)), "pack"))
    return out + (paged_programs(backends, dataclasses.replace(shape, page_size=page_size))
                  if page_size else [])


def paged_programs(backends: list[str], shape: cp.DecodeShape) -> list[Program]:
    """The plain step, the verify round and the sync round over paged target and drafter caches."""
    tail, out = f", paged {shape.page_size}", []
    for b in backends:
        out += [Program("plain step" + tail, "h200", b, lambda m, b=b: cp.plain_step(shape, b, m), "decode"),
                Program("verify round" + tail, "h200", b, lambda m, b=b: cp.verify_round(shape, b, m), "decode"),
                Program("sync round" + tail, "h200", b, lambda m, b=b: cp.sync_round(shape, b, m), "decode")]
    return out


def tpu_paged_programs(small: bool, cache_len: int, page_size: int) -> list[Program]:
    """The plain step and the verify round over paged caches on a TPU v5e-8 (the target over its
    8 chips, KV heads split; under its mesh, so the Mosaic decode kernel reads the pages)."""
    from d3d_jax.parallel.sharding import MESH_AXES

    shape = cp.DecodeShape(_spec(TARGET, small), _spec(DRAFTERS[0], small), cache_len=cache_len,
                           page_size=page_size)
    mesh = lambda chips: ((1, 1, chips), MESH_AXES)  # noqa: E731
    return [Program(f"{name}, paged {page_size}", "tpu-v5e-8", "pallas",
                    lambda m, w=w: cp.under_mesh(cp.split_target_step(shape, "pallas", m, 1, w), m), "decode",
                    (), mesh)
            for name, w in (("plain step", 1), ("verify round", shape.block_size))]


def split_programs(backends: list[str], args) -> list[Program]:
    """The target alone over ``args.target_devices`` devices: its plain step and its async
    verify round, ``args.split_rows`` x ``args.cache_len`` (the drafter's side keeps its own device)."""
    from d3d_jax.parallel.sharding import MESH_AXES

    n, rows = args.target_devices, args.split_rows
    shape = cp.DecodeShape(cp.ModelSpec(args.split_target, args.split_target), DRAFTERS[0],
                           cache_len=args.cache_len)
    tail, mesh = f", {args.split_target} over {n} devices", (lambda chips: ((1, 1, chips), MESH_AXES))
    return [Program(name + tail, f"{n}xh200", b,
                    lambda m, b=b, w=w: cp.split_target_step(shape, b, m, rows, w), "decode", (), mesh)
            for b in backends for name, w in (("plain step", 1), ("verify round", shape.block_size))]


def _train_mesh(config: str):
    def sizes(chips: int):
        from d3d_jax.parallel.sharding import MESH_AXES

        cfg, _ = cp.train_config(config, chips)
        return cfg.mesh.axis_sizes(chips), MESH_AXES
    return sizes


def kernel_program(small: bool) -> Program:
    """The fused kernels alone, forward and backward, on a training pack (their PTX facts)."""
    shape = cp.KernelShape(length=512 if small else 6144)
    return Program(f"flash kernels, {shape.length}-token pack fwd+bwd", "h200", "pallas",
                   lambda m: cp.flash_kernels(shape, m), "kernels")


def train_program(name: str, config: str, device: str, backend: str, small: bool,
                  options: tuple = (), layers: int = 0) -> Program:
    layers = 2 if small and not layers else layers
    name += f", {layers} layers" if layers else ""
    overrides = (f"model.attention_backend={backend}",) + ((f"model.num_layers={layers}",) if layers else ())
    if small:  # short rows, few anchors: the suite's compile
        overrides += ("data.packed_length=512", "data.num_anchors=16")
    return Program(name, device, backend, lambda m: cp.train_step(config, m, overrides), "train",
                   options, _train_mesh(config))


def programs(args) -> list[Program]:
    from d3d_jax.config.base import CONFIG_DIR

    small, backends = args.small, [b for b in args.backends.split(",") if b]
    tbs = [b for b in args.train_backend.split(",") if b] or ["xla"]
    tb, depths = tbs[-1], args.train_layers
    c17, c8 = str(CONFIG_DIR / "train/d3d-1.7b.yaml"), str(CONFIG_DIR / "train/d3d-8b.yaml")
    # per depth, smallest first: the memory with each backend, then the flops with the last
    pod = [p for d in depths for p in
           [train_program("D3D-8B train step", c8, "tpu-v5p-128", b, small, layers=d) for b in tbs]
           + [train_program("D3D-8B train step, flops", c8, "tpu-v5p-128", tb, small, NO_WINDOWED_EINSUM,
                            layers=d)]]
    plat = {
        "h200": [kernel_program(small)] + decode_programs(backends, small, 256 if small else args.cache_len,
                                                         args.kv_page_size)
        + [train_program("D3D-1.7B train step", c17, "8xh200", tb, small, layers=d) for d in depths]
        + (split_programs(backends, args) if args.target_devices > 1 else []),
        "tpu-v5p-128": pod,
        "tpu-v5e-8": [train_program("D3D-1.7B train step", c17, "tpu-v5e-8", tb, small, layers=d)
                      for d in depths]
        + (tpu_paged_programs(small, 256 if small else args.cache_len, args.kv_page_size)
           if args.kv_page_size else []),
    }
    chosen = [p for k, ps in plat.items() if args.platform in (k, "all") for p in ps]
    only = [o.strip().lower() for o in args.only.split(",")]
    chosen = [p for p in chosen if any(p.name.lower() == o[1:] if o.startswith("=") else o in p.name.lower()
                                       for o in only)]
    # what the goal checks read comes first: a run cut short keeps those rows (JSON per program)
    return sorted(chosen, key=lambda p: next((i for i, k in enumerate(FIRST) if k(p)), len(FIRST)))


FIRST = (lambda p: p.kind == "kernels",
         lambda p: p.kind == "decode" and p.backend == "pallas" and p.name.startswith(("plain", "verify")),
         lambda p: p.name == "branch pack, 1.7B drafter",
         lambda p: "D3D-8B" in p.name)


# --------------------------------------------------------------------------------------
# Compiling one program
# --------------------------------------------------------------------------------------
def compile_one(prog: Program, topo, dump: Path) -> tuple[dict, object, dict]:
    """``(result, compiled or None, facts)``: the compiler's error is a result, not a crash."""
    dev = ct.device(prog.device)
    sizes, axes = prog.mesh_shape(dev.chips) if prog.mesh_shape else ((dev.chips,), ("x",))
    mesh = ct.mesh(topo, sizes, axes)
    t0 = time.perf_counter()
    with kvc.caches_for(dev.platform):  # the device's cache layout, not the CPU host's
        built = prog.build(mesh)
    options = {"xla_dump_to": str(dump), **dict(prog.options)}
    ctx = built.mesh_context() if built.mesh_context else contextlib.nullcontext()
    res = {"program": prog.name, "device": dev.name, "chips": dev.chips, "backend": prog.backend,
           "kind": prog.kind, "options": dict(prog.options)}
    try:
        with ctx, kvc.caches_for(dev.platform):
            compiled = built.fn.trace(*built.args).lower().compile(compiler_options=options)
    except Exception as e:  # noqa: BLE001 - the compiler's own error is the result
        res.update(compiled=False, error=_error_line(e), compile_s=time.perf_counter() - t0)
        return res, None, built.facts
    res.update(compiled=True, compile_s=time.perf_counter() - t0)
    return res, compiled, built.facts


def _error_line(e: Exception) -> str:
    """The line of a compiler error that names the problem (XLA errors run to many lines)."""
    text = f"{type(e).__name__}: {e}"
    for key in ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "INTERNAL", "UNIMPLEMENTED", "Error"):
        for line in text.splitlines():
            if key in line:
                return line.strip()[:600]
    return text.splitlines()[0][:600] if text else repr(e)


def analyse(res: dict, compiled, facts: dict, dump: Path, dev: ct.Device) -> dict:
    """Memory, costs with the corrections, roofline and ideal of one compiled program."""
    hlo = compiled.as_text()
    mem = cf.memory(compiled)
    xla = cf.xla_cost(compiled)
    extras, calls = cf.walk(hlo, facts.get("tables", set()))
    flops = xla["flops"] + extras.kernel_flops
    bytes_ = xla["bytes"] - extras.lookup_overcount + extras.kernel_bytes
    res.update(memory=mem, memory_over_hbm=mem["peak"] / dev.hbm_bytes, xla=xla,
               lookup_overcount_bytes=extras.lookup_overcount, kernel_flops=extras.kernel_flops,
               kernel_bytes=extras.kernel_bytes, flops=flops, bytes=bytes_,
               xla_bytes_corrected=xla["bytes"] - extras.lookup_overcount,
               kernel_calls=_kernel_summary(calls), tpu_custom_calls=cf.tpu_custom_calls(hlo),
               facts={k: v for k, v in facts.items() if k != "tables"})
    res["roofline"] = {"flops_s": flops / dev.peak_bf16_flops, "bytes_s": bytes_ / dev.hbm_bandwidth}
    res["roofline"]["s"] = max(res["roofline"].values())
    res["roofline"]["bound"] = "compute" if res["roofline"]["flops_s"] >= res["roofline"]["bytes_s"] else "memory"
    res["ideal"] = ideal(res, facts)
    if dev.platform == "cuda":
        res["gpu_kernels"] = cf.gpu_kernels(dump, KERNEL_PREFIXES)
    return res


def _kernel_summary(calls: list[dict]) -> list[dict]:
    """Kernel calls grouped by name and shapes (a call per layer and span bucket otherwise)."""
    groups: dict = {}
    for c in calls:
        # all operands: a decode call's K/V are the whole stacked cache, its span is in the metadata
        key = (c["name"], str(c["operands"]), c["in_branch"])
        span = [f"S={kernel_cost.dims(c)['s']}"] if c["estimated"] else []
        g = groups.setdefault(key, {"name": c["name"], "target": c["target"], "calls": 0,
                                    "operands": [f"{dt}{list(s)}" for dt, s in kernel_cost.qkv(c)] + span,
                                    "in_branch": c["in_branch"], "estimated": c["estimated"],
                                    "flops_each": c["flops"], "bytes_each": c["bytes"],
                                    "issued_bytes_each": c["issued_bytes"]})
        g["calls"] += 1
    return list(groups.values())


def ideal(res: dict, facts: dict) -> dict:
    """The program's ideal and its ratios: a decode step reads every weight once (minus the
    embedding table, of which it reads its rows) and the whole cache; a train step's flops are
    the hand count."""
    if res["kind"] == "kernels":
        return {}
    if res["kind"] == "train":
        hand = facts["hand_flops"]["total"] / res["chips"]
        return {"hand_flops_per_chip": hand, "flops_over_hand": res["flops"] / hand,
                "xla_flops_over_hand": res["xla"]["flops"] / hand}
    who = "target" if "target_weights_bytes" in facts else "drafter"
    weights = facts.get("target_weights_bytes", 0) + facts.get("drafter_weights_bytes", 0)
    cache = facts.get("target_cache_bytes", 0) + facts.get("drafter_cache_bytes", 0)
    tables = sum(facts.get(f"{w}_embedding_bytes", 0) - facts["rows"] * facts.get(f"{w}_row_bytes", 0)
                 for w in ("target", "drafter"))
    need = weights + cache - max(tables, 0)
    return {"weights_bytes": weights, "cache_bytes": cache, "weights_plus_cache": weights + cache,
            "ideal_bytes": need, "side": who,
            "xla_bytes_over_weights_plus_cache": res["xla"]["bytes"] / (weights + cache),
            "corrected_xla_bytes_over_weights_plus_cache": res["xla_bytes_corrected"] / (weights + cache),
            "bytes_over_ideal": res["bytes"] / need, "bytes_over_weights": res["bytes"] / weights}


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------
def run(args) -> dict:
    from d3d_jax.bench import compile_report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = programs(args)
    result = {"settings": {k: v for k, v in vars(args).items() if k != "func"},
              "environment": _environment(), "programs": []}
    topos: dict = {}
    for i, prog in enumerate(chosen):
        dev = ct.device(prog.device)
        print(f"[{i + 1}/{len(chosen)}] {prog.name} ({prog.backend}) for {dev.chips} x {dev.name} ...", flush=True)
        if prog.device not in topos:
            topos[prog.device] = ct.topology(dev)
        dump = Path(tempfile.mkdtemp(prefix="xla_dump_", dir=out))
        try:
            res, compiled, facts = compile_one(prog, topos[prog.device], dump)
            if compiled is not None:
                res = analyse(res, compiled, facts, dump, dev)
            del compiled
        except Exception as e:  # noqa: BLE001 - one broken builder must not lose the others' results
            res = {"program": prog.name, "device": dev.name, "backend": prog.backend, "kind": prog.kind,
                   "compiled": False, "error": _error_line(e), "traceback": traceback.format_exc()[-2000:]}
        _keep_or_drop(dump, out, args.keep_dumps, i)
        result["programs"].append(res)
        print("   " + compile_report.one_line(res), flush=True)
        (out / "bench_compile.json").write_text(json.dumps(result, indent=2, default=str))
    result["checks"] = compile_report.checks(result["programs"])
    md = compile_report.markdown(result)
    (out / "bench_compile.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "bench_compile.md").write_text(md)
    return result


def _keep_or_drop(dump: Path, out: Path, keep: bool, i: int) -> None:
    if keep:
        dest = out / "dumps" / f"{i:02d}"
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dump.rename(dest)
    else:
        shutil.rmtree(dump, ignore_errors=True)


def _environment() -> dict:
    import platform

    import jax

    return {"jax": jax.__version__, "python": platform.python_version(), "host_cpus": os.cpu_count(),
            "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "jax_platforms": os.environ.get("JAX_PLATFORMS", "")}


def main(args: argparse.Namespace) -> dict:
    """Entry point of ``infer/bench.py compile``."""
    if os.environ.get("JAX_PLATFORMS", "cpu") != "cpu":
        print("bench compile: JAX_PLATFORMS is not cpu; the programs still compile for the described "
              "devices, never for the local one", flush=True)
    result = run(args)
    print("\n" + (Path(args.out) / "bench_compile.md").read_text(), flush=True)
    return result
