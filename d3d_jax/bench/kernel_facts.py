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
