"""Devices that ``infer/bench.py compile`` compiles for without having them (``JAX_PLATFORMS=cpu``).

A GPU comes from XLA's target description (``configs/devices/h200.txtpb``: an sm_90 part with the
H200's 141 GB and 4.8 TB/s) and needs the CUDA plugin of the pinned jax (``jax-cuda13-plugin``,
``jax-cuda13-pjrt``) plus ``ptxas``; a TPU comes from libtpu's topology descriptions (``jax[tpu]``).
Nothing here starts a device: :func:`mesh` builds a compile-only mesh over described devices.

The datasheet figures (dense bf16 peak, HBM bandwidth and size) feed the roofline only; they are
leads for reading a compile next to a measured run, not measurements.
"""

from __future__ import annotations

import dataclasses
import os

from d3d_jax.config.base import CONFIG_DIR, ConfigError


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator chip (a GPU, or a TPU chip with its TensorCores) as the roofline sees it."""

    name: str
    platform: str  # "cuda" or "tpu"
    peak_bf16_flops: float  # dense, per chip
    hbm_bandwidth: float  # bytes/s
    hbm_bytes: float  # what XLA may allocate
    topology: str  # GPU: slices x hosts x devices; TPU: libtpu's topology name
    spec_file: str = ""  # GPU: target description under configs/devices/
    tpu_kwargs: tuple = ()  # TPU: extra get_topology_desc arguments

    @property
    def chips(self) -> int:
        dims = self.topology.split(":")[-1].split("x")
        n = 1
        for d in dims:
            n *= int(d)
        return n


_V5P = dict(name="TPU v5p", platform="tpu", peak_bf16_flops=459e12, hbm_bandwidth=2.765e12,
            hbm_bytes=95.74e9)
_V5E = dict(name="TPU v5e", platform="tpu", peak_bf16_flops=197e12, hbm_bandwidth=0.819e12,
            hbm_bytes=15.75e9)
_H200 = dict(name="NVIDIA H200", platform="cuda", peak_bf16_flops=989e12, hbm_bandwidth=4.8e12,
             hbm_bytes=150754820096.0, spec_file="h200.txtpb")
_HOSTS = (("chips_per_host_bounds", (2, 2, 1)), ("num_slices", 1))

DEVICES: dict[str, Device] = {
    "h200": Device(topology="1x1x1", **_H200),
    "8xh200": Device(topology="1x1x8", **_H200),
    # Cloud counts v5p TensorCores: v5p-128 is 64 chips (4x4x4), each chip one megacore device
    "tpu-v5p-128": Device(topology="v5:4x4x4", tpu_kwargs=(("chip_config_name", "megacore"),) + _HOSTS,
                          **_V5P),
    "tpu-v5e-8": Device(topology="v5e:2x4", tpu_kwargs=_HOSTS, **_V5E),
}


def device(name: str) -> Device:
    """A device of :data:`DEVICES`, or ``Nxh200``: N H200s on one host (a tensor-parallel slice)."""
    count, _, base = name.partition("xh200")
    if name not in DEVICES and count.isdigit() and int(count) >= 1 and not base:
        return Device(topology=f"1x1x{int(count)}", **_H200)
    if name not in DEVICES:
        raise ConfigError(f"--platform: unknown device {name!r} (known: {', '.join(DEVICES)})")
    return DEVICES[name]


def topology(dev: Device):
    """The compile-only topology of ``dev``: a clear error when its plugin is missing."""
    from jax.experimental import topologies

    if dev.platform == "cuda":
        _require_module("jax_cuda13_plugin", "jax-cuda13-plugin==0.10.2 jax-cuda13-pjrt==0.10.2",
                        dev)
        spec = (CONFIG_DIR / "devices" / dev.spec_file).read_text()
        return topologies.get_topology_desc(platform="cuda", topology=dev.topology,
                                            target_config=spec)
    _require_module("libtpu", "'jax[tpu]==0.10.2'", dev)
    # no TPU metadata server here: say so, or libtpu logs a failed look-up per compile
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return topologies.get_topology_desc(platform="tpu", topology_name=dev.topology,
                                        **dict(dev.tpu_kwargs))


def _require_module(module: str, pip_spec: str, dev: Device) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"--platform: compiling for {dev.name} needs {module} "
                          f"(pip install {pip_spec}, or pip install -e '.[compile]')")


def available(name: str) -> str | None:
    """None when ``name`` can be compiled for here, else why not (for tests to skip on)."""
    import shutil

    dev = device(name)
    try:
        _require_module("jax_cuda13_plugin" if dev.platform == "cuda" else "libtpu", "", dev)
    except ConfigError as e:
        return str(e)
    if dev.platform == "cuda" and shutil.which("ptxas") is None:
        return "ptxas is not on the PATH (CUDA toolkit, or pip install nvidia-cuda-nvcc)"
    return None


def mesh(topo, sizes: tuple[int, ...], axes: tuple[str, ...]):
    """A mesh over the topology's devices (all of them: ``prod(sizes)`` must equal their count)."""
    from jax.experimental import topologies

    return topologies.make_mesh(topo, tuple(sizes), tuple(axes))
