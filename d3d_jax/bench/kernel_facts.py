"""What the real compilers say about a kernel, without the device: compile for a deviceless
H200 or TPU topology on a CPU host and read the facts that decide speed.

GPU (``jax-cuda13-plugin`` + ``ptxas``): :func:`gpu_compile` runs XLA's whole GPU pipeline
(Triton and ptxas included) for a spec from ``configs/devices/`` and returns, per Triton kernel, the
PTX facts (async copies, ``wgmma`` and ``mma.sync`` counts, registers and spills from
``ptxas -v``, the grid and CTAs from the custom call).  TPU (libtpu): :func:`tpu_compile`
compiles for a topology and counts the Mosaic kernels (``tpu_custom_call``) in the compiled text.

Every function needs ``JAX_PLATFORMS=cpu`` and the matching plugin; nothing here runs a kernel.
:func:`attention_cost` is the traffic/flops estimate of one fused-attention kernel call (XLA's
cost analysis counts a custom kernel as 0).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import jax

from d3d_jax.config.base import CONFIG_DIR

SPEC_DIR = CONFIG_DIR / "devices"  # XLA GpuTargetConfigProto text files, one per GPU
_PTX_OPS = {  # fact name -> PTX instruction prefix
    "async_copies": ("cp.async.", ("cp.async.commit", "cp.async.wait", "cp.async.bulk.commit",
                                   "cp.async.bulk.wait")),
    "wgmma": ("wgmma.mma_async", ()),
    "mma_sync": ("mma.sync", ()),
}


@dataclasses.dataclass(frozen=True)
class KernelFacts:
    """One compiled Triton kernel, as the PTX and ptxas report it."""

    name: str
    async_copies: int  # cp.async / cp.async.bulk (TMA) copy instructions, not commits or waits
    wgmma: int  # Hopper warpgroup MMAs (wgmma.mma_async)
    mma_sync: int  # Ampere-style warp MMAs
    registers: int
    spill_bytes: int  # spill stores + loads
    shared_bytes: int
    grid: tuple[int, int, int]
    num_warps: int

    @property
    def ctas(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def gpu_target_config(name: str = "h200") -> str:
    """XLA's ``GpuTargetConfigProto`` text for a GPU spec in ``configs/devices/`` (h200)."""
    path = SPEC_DIR / f"{name}.txtpb"
    if not path.exists():
        known = sorted(p.stem for p in SPEC_DIR.glob("*.txtpb"))
        raise ValueError(f"unknown GPU spec {name!r}; known: {', '.join(known)}")
    return path.read_text()


def gpu_mesh(spec: str = "h200", devices: int = 1, axis: str = "x"):
    """A mesh of ``devices`` compile-only GPUs of ``spec`` (one host)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{devices}",
                                        target_config=gpu_target_config(spec))
    return topologies.make_mesh(topo, (devices,), (axis,))


def abstract(mesh, tree) -> Any:
    """``ShapeDtypeStruct``s of ``tree`` (arrays or shape structs), replicated on ``mesh``."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    sh = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree)


def gpu_compile(fn: Callable, *args, spec: str = "h200", dump_dir: str | None = None
                ) -> tuple[Any, list[KernelFacts]]:
    """Compile ``jax.jit(fn)(*args)`` for a deviceless ``spec`` GPU; ``(compiled, kernel facts)``.

    ``args`` are arrays or ``ShapeDtypeStruct``s (placed on the one-GPU mesh).  Raises what the
    compiler raises (a kernel that does not fit shared memory, a bad tile shape ...).
    """
    mesh = gpu_mesh(spec)
    tmp = dump_dir or tempfile.mkdtemp(prefix="kernel_facts_")
    try:
        lowered = jax.jit(fn).trace(*abstract(mesh, args)).lower()
        compiled = lowered.compile(compiler_options={"xla_dump_to": tmp})
        return compiled, dump_facts(tmp)
    finally:
        if dump_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)


def dump_facts(dump_dir: str) -> list[KernelFacts]:
    """Facts of every Triton kernel in an XLA GPU dump directory (``--xla_dump_to``)."""
    hlo = "\n".join(p.read_text() for p in Path(dump_dir).glob("*gpu_after_optimizations.txt"))
    launches = _triton_launches(hlo)
    facts, seen = [], set()
    for ptx_path in sorted(Path(dump_dir).glob("*.ptx")):
        ptx = ptx_path.read_text()
        for name in re.findall(r"\.visible \.entry (\w+)\(", ptx):
            if name not in launches or name in seen:
                continue
            seen.add(name)
            facts.append(_facts(name, ptx, ptx_path, launches[name]))
    return facts


def _triton_launches(hlo: str) -> dict[str, tuple[tuple[int, int, int], int]]:
    """kernel name -> (grid, num_warps) from the Triton custom calls' backend configs."""
    out = {}
    for cfg in re.findall(r'backend_config=\{debug = [^\n]*', hlo):
        name = re.search(r'name = "([^"]+)"', cfg)
        grid = tuple(int(re.search(rf"grid_{a} = (\d+)", cfg).group(1)) for a in "xyz")
        warps = re.search(r"num_warps = (\d+)", cfg)
        if name:
            out[name.group(1)] = (grid, int(warps.group(1)) if warps else 0)
    return out


def _facts(name: str, ptx: str, path: Path, launch) -> KernelFacts:
    body = ptx.split(f".entry {name}(", 1)[1]
    counts = {}
    for fact, (prefix, exclude) in _PTX_OPS.items():
        ops = re.findall(rf"^\s*(?:@%p\d+\s+)?({re.escape(prefix)}[\w.:]*)", body, re.M)
        counts[fact] = sum(not op.startswith(exclude) for op in ops) if exclude else len(ops)
    regs, spills, smem = _ptxas(path, name)
    return KernelFacts(name, counts["async_copies"], counts["wgmma"], counts["mma_sync"], regs, spills,
                       smem, launch[0], launch[1])


def _ptxas(path: Path, name: str, arch: str = "sm_90a") -> tuple[int, int, int]:
    """(registers, spill bytes, static shared bytes) of one entry, from ``ptxas -v``."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        raise RuntimeError("ptxas not on PATH: install the CUDA toolkit or `pip install nvidia-cuda-nvcc`")
    res = subprocess.run([ptxas, f"-arch={arch}", "-v", str(path), "-o", "/dev/null"],
                         capture_output=True, text=True, check=True)
    text = res.stderr.split(f"for {name}", 1)[-1]
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    regs = re.search(r"Used (\d+) registers", text)
    smem = re.search(r"(\d+) bytes smem", text)
    return (int(regs.group(1)) if regs else -1,
            int(spill.group(1)) + int(spill.group(2)) if spill else -1,
            int(smem.group(1)) if smem else 0)


def facts_table(facts: Sequence[KernelFacts], title: str = "") -> str:
    """A Markdown table of kernel facts."""
    rows = [f"| {f.name} | {f.async_copies} | {f.wgmma} | {f.mma_sync} | {f.registers} | {f.spill_bytes} | "
            f"{'x'.join(map(str, f.grid))} = {f.ctas} | {f.num_warps} |" for f in facts]
    head = ("| kernel | async copies | wgmma | mma.sync | registers | spill bytes | grid = CTAs | warps |\n"
            "|---|---|---|---|---|---|---|---|")
    return "\n".join(([f"**{title}**", ""] if title else []) + [head] + rows)


# --------------------------------------------------------------------------------------
# TPU
# --------------------------------------------------------------------------------------
def tpu_mesh(topology: str = "v5:1x1x1", shape: tuple[int, ...] | None = None, axes: tuple[str, ...] = ("x",),
             **topology_kwargs):
    """A mesh over a compile-only TPU topology (libtpu), e.g. ``v5:4x4x4`` with
    ``chip_config_name="megacore", chips_per_host_bounds=(2, 2, 1)``."""
    import os

    from jax.experimental import topologies

    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server on a CPU host
    topology_kwargs.setdefault("chip_config_name", "megacore")
    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology, **topology_kwargs)
    shape = shape or (len(topo.devices),)
    return topologies.make_mesh(topo, shape, axes)


@dataclasses.dataclass(frozen=True)
class TpuFacts:
    """What a compile-only TPU executable says: Mosaic kernels and per-chip memory."""

    custom_calls: int  # tpu_custom_call ops (Mosaic kernels) in the compiled HLO
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    peak_bytes: int  # what memory_analysis reports as the program's peak per chip


def tpu_facts(compiled) -> TpuFacts:
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    peak = getattr(mem, "peak_memory_in_bytes", 0) or (mem.temp_size_in_bytes + mem.argument_size_in_bytes
                                                        + mem.output_size_in_bytes - mem.alias_size_in_bytes)
    return TpuFacts(len(re.findall(r'custom_call_target="tpu_custom_call"', text)), mem.temp_size_in_bytes,
                    mem.argument_size_in_bytes, mem.output_size_in_bytes, int(peak))


def tpu_compile(fn: Callable, *args, mesh=None) -> tuple[Any, TpuFacts]:
    """Compile ``jax.jit(fn)(*args)`` for a compile-only TPU (one chip of ``v5:1x1x1`` by default)."""
    mesh = mesh if mesh is not None else tpu_mesh()
    compiled = jax.jit(fn).trace(*abstract(mesh, args)).lower().compile()
    return compiled, tpu_facts(compiled)


# --------------------------------------------------------------------------------------
# Per-kernel cost (XLA's cost analysis counts a custom kernel as 0)
# --------------------------------------------------------------------------------------
# Matmul flops per (query, key, head-dim) triple: forward QKᵀ + PV; dQ recomputes QKᵀ, dO·Vᵀ and
# adds dS·K; dK/dV recompute QKᵀ, dO·Vᵀ and add dSᵀQ, PᵀdO.  2 flops per multiply-add.
FLOPS_PER_PAIR = {"d3d_flash_fwd": 4, "d3d_flash_dq": 6, "d3d_flash_dkv": 8, "d3d_flash_decode": 4}


def _nbytes(dtype: str, shape) -> int:
    import numpy as np

    size = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "pred": 1}.get(dtype)
    return int(np.prod(shape)) * (size if size is not None else np.dtype(dtype).itemsize)


def _dims(call: dict) -> dict:
    """Attention dims of one kernel call from its operand/result shapes (operand order of
    :mod:`~d3d_jax.model.flash_kernels`, :mod:`~d3d_jax.model.flash_decode`, :mod:`~d3d_jax.model.flash_tpu`:
    the live-tile list and its count come first, then q, k, v)."""
    name, ops, res = call["name"], call["operands"], call["results"]
    (qdt, q), (kdt, k) = ops[2], ops[3]
    if name == "d3d_flash_decode":  # q [B, K, R, H], k [L, B, S_max, K, H], kpos [B, S]
        b, kh, rows, h = q
        return dict(b=b, n=kh, t=rows, h=h, kh=kh, s=ops[7][1][-1], dt=kdt, g=1,
                    partials=sum(_nbytes(*r) for r in res))
    if len(q) == 4:  # GPU: q [B, T, N, H], k [B, S, K, H]
        b, t, n, h = q
        return dict(b=b, t=t, n=n, h=h, s=k[1], kh=k[2], dt=kdt, g=n // k[2], partials=0)
    # TPU: q [B, T, N*H], k [(L,) B, S, K*H]; the head count from a statistics array [B, N, ., .]
    stats = res[1][1] if name == "d3d_flash_fwd" else ops[6][1]
    b, t, nh = q
    n = stats[1]
    h = nh // n
    return dict(b=b, t=t, n=n, h=h, s=k[-2], kh=k[-1] // h, dt=kdt, g=n // (k[-1] // h), partials=0)


def kernel_cost(call: dict, live_fraction: float = 1.0) -> dict:
    """``{flops, transcendentals, bytes, issued_bytes, estimated}`` of one fused-attention call.

    ``call`` = ``{"name", "operands": [(dtype, shape)], "results": [...], "grid": [...]}`` (as the
    compiled HLO's custom call gives them).  With ``f = live_fraction`` of the (query tile, key
    tile) pairs live (1.0: the upper bound a compile can state; a training pack of 6144 has
    ~0.35, ``live_fraction`` measures one), ``dt`` the K/V element size:

    * flops = ``c · B·N·T·S·H · f`` with c from :data:`FLOPS_PER_PAIR`; exps = ``B·N·T·S·f``;
    * ``bytes``: every operand read once and every result written once (the HBM traffic when the
      K/V re-reads hit L2);
    * ``issued_bytes``: what the CTAs load with no L2 reuse.  Forward / dQ: every (row, head, query
      tile) reads its live K/V tiles, ``B·N·(T/bq)·f·S·2H·dt``; dK/dV: every (row, kv head, key
      tile) reads the live query tiles of its g heads, ``B·K·(S/bk)·g·f·T·(2H·dt + 8)``; decode:
      every (row, kv head, row tile) reads its live K/V once across its splits,
      ``B·K·(R/br)·f·S·2H·dt``, plus the float32 partials it writes (and XLA's merge reads back).
    """
    name = call["name"]
    if name not in FLOPS_PER_PAIR or len(call["operands"]) < 4:
        return {"flops": 0.0, "transcendentals": 0.0, "bytes": 0.0, "issued_bytes": 0.0, "estimated": False}
    d, f = _dims(call), float(live_fraction)
    b, n, t, s, h, kh = d["b"], d["n"], d["t"], d["s"], d["h"], d["kh"]
    elt = _nbytes(d["dt"], (1,))
    once = float(sum(_nbytes(*o) for o in call["operands"]) + sum(_nbytes(*r) for r in call["results"]))
    grid = list(call.get("grid") or [1])
    kv_live = f * s * 2 * h * elt
    if name == "d3d_flash_dkv":
        key_tiles = grid[-1] if len(grid) == 3 else grid[2]
        issued = b * kh * key_tiles * d["g"] * f * t * (2 * h * elt + 8) + 2 * _nbytes(d["dt"], (b, s, kh, h)) * 2
    elif name == "d3d_flash_decode":
        row_tiles = grid[2] if len(grid) == 4 else 1
        issued = b * kh * row_tiles * kv_live + 2 * d["partials"]
    else:
        query_tiles = grid[2] if len(grid) >= 3 else 1
        issued = b * n * query_tiles * kv_live + once - 2 * _nbytes(d["dt"], (b, s, kh, h))
    pairs = b * n * t * s * f
    return {"flops": FLOPS_PER_PAIR[name] * pairs * h, "transcendentals": pairs, "bytes": once,
            "issued_bytes": float(max(issued, once * f)), "estimated": True}


def live_fraction(q_meta, k_meta, block_q: int = 64, block_k: int = 64) -> float:
    """Share of (query tile, key tile) pairs the kernels visit for this metadata."""
    from d3d_jax.model.flash_attention import tile_visibility

    return float(tile_visibility(q_meta, k_meta, block_q, block_k).mean())
