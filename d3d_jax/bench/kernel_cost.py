"""Each fused attention kernel's own cost, from the shapes of its call (XLA counts a kernel as 0).

The one per-kernel estimate of the project (``infer/bench.py compile`` adds it to XLA's cost).
A call is read from the compiled HLO (:func:`~d3d_jax.bench.compile_facts.walk`): its name, its
operands and results ``(dtype, shape)`` in the kernels' argument order (the live-tile list and
its count ``[B, tiles]`` first, then q, k, v, ...; :mod:`~d3d_jax.model.flash_kernels`,
:mod:`~d3d_jax.model.flash_decode`, :mod:`~d3d_jax.model.flash_tpu`) and its grid.  With ``B``
rows, ``N`` query heads over ``K`` kv heads (``g = N/K``), ``T`` queries, ``S`` keys, head dim
``H``, K/V element size ``e`` and ``f`` the share of (query tile, key tile) pairs that are live:

* **flops** = ``c·B·N·T·S·H·f``, ``c`` = 4 for a forward (QKᵀ and PV; the decode kernel too),
  6 for dQ (QKᵀ, dO·Vᵀ, dS·K), 8 for dK/dV (QKᵀ, dO·Vᵀ, dSᵀQ, PᵀdO); exps = ``B·N·T·S·f``.
  A compile cannot know the metadata, so the bench uses ``f = 1`` (an upper bound: a 6144-token
  training pack has ~0.35 live, :func:`live_fraction` measures a layout).
* **bytes** (the roofline's): every operand read once and every result written once, K/V
  counted over the ``S`` keys the kernel may read.  The decode kernel's K/V operands are the
  whole stacked cache ``[L, B, S_max, K, H]`` or paged pool (read in place; a page table's
  operand is left out): it reads one layer's first ``S`` slots of each row, ``B·S·K·H·e`` each,
  which is what is counted.  This is the traffic when the re-reads
  (one per query head of a group and per query tile) hit L2.
* **issued_bytes**: what the CTAs load with no L2 reuse.  Forward / dQ: every (row, head, query
  tile) reads its live K/V tiles, ``B·N·(T/bq)·f·S·2H·e``; dK/dV: every (row, kv head, key
  tile) reads the live query tiles of its ``g`` heads, ``B·K·(S/bk)·g·f·T·(2H·e + 8)``; decode:
  every (row, kv head, row tile) reads its live K/V once across its splits, ``B·K·(R/br)·f·S·2H·e``
  (``R = T·g`` stacked rows), plus the float32 partials it writes and XLA's merge reads back.

Calls of other custom kernels (cuBLAS, TopK, Mosaic kernels not named ``d3d_flash_*``) carry no
estimate: ``estimated`` is False and the report lists them.
"""

from __future__ import annotations

import math

FLOPS_PER_PAIR = {"d3d_flash_fwd": 4, "d3d_flash_dq": 6, "d3d_flash_dkv": 8, "d3d_flash_decode": 4}
_NONE = {"flops": 0.0, "transcendentals": 0.0, "bytes": 0.0, "issued_bytes": 0.0, "estimated": False}


# Bytes per element of an HLO dtype (unknown: 4).  Here, not in compile_facts (which reads HLO
# and imports this module), so the two do not import each other.
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    size = DTYPE_BYTES.get(dtype, 4)
    for d in shape:
        size *= int(d)
    return size


def _size(dtype_shape) -> int:
    return nbytes(*dtype_shape)


def qkv(call: dict) -> list:
    """The ``(dtype, shape)`` of q, k, v in a call (after the live-tile list and its count)."""
    return call["operands"][2:5] if call["name"] in FLOPS_PER_PAIR else call["operands"][:3]


def dims(call: dict) -> dict:
    """Attention dims of one call from its operand/result shapes."""
    name, ops, res = call["name"], call["operands"], call["results"]
    (_, q), (kdt, k) = ops[2], ops[3]
    # q [B, K, R, H] (a group's heads stacked), k [L, B, S_max, K, H] or a pool [L, pages, page_size, K, H]
    if name == "d3d_flash_decode":
        b, kh, rows, h = q
        return dict(b=b, n=kh, t=rows, h=h, kh=kh, s=ops[7][1][-1], dt=kdt, g=1, layered=True)
    if len(q) == 4:  # GPU: q [B, T, N, H], k [B, S, K, H]
        b, t, n, h = q
        return dict(b=b, t=t, n=n, h=h, s=k[1], kh=k[2], dt=kdt, g=n // k[2], layered=False)
    # TPU: q [B, T, N*H], k [(L,) B, S, K*H]; the head count from a statistics array [B, N, ., .]
    stats = res[1][1] if name == "d3d_flash_fwd" else ops[6][1]
    b, t, nh = q
    n = stats[1]
    h = nh // n
    # a stacked cache [L, B, S_max, K*H] (the keys are kpos's [B, 1, S]) or a paged pool
    # [L, pages, page_size, K*H] (kpos [B, S / bk, 1, bk])
    layered = len(k) == 4
    s = math.prod(ops[7][1][1:]) if layered else k[-2]
    return dict(b=b, t=t, n=n, h=h, s=s, kh=k[-1] // h, dt=kdt, g=n // (k[-1] // h), layered=layered)


def estimate(call: dict, live_fraction: float = 1.0) -> dict:
    """``{flops, transcendentals, bytes, issued_bytes, estimated}`` of one call (module doc)."""
    name, ops = call["name"], call["operands"]
    if name not in FLOPS_PER_PAIR or len(ops) < 5:
        return dict(_NONE)
    d, f = dims(call), float(live_fraction)
    b, n, t, s, h, kh, g = d["b"], d["n"], d["t"], d["s"], d["h"], d["kh"], d["g"]
    e = _size((d["dt"], (1,)))
    kv_bytes = b * s * kh * h * e  # one of K, V over the keys the call may read
    operands = [_size(o) for o in ops]
    if d["layered"]:  # a stacked cache read in place: one layer's first S slots
        operands[3] = operands[4] = kv_bytes
    results = sum(_size(r) for r in call["results"])
    once = float(sum(operands) + results)
    # the live-tile count is [B, tiles]: query tiles (forward, dQ), key tiles (dK/dV), row tiles (decode)
    tiles = int(ops[1][1][-1]) if ops[1][1] else 1
    kv_live = f * s * 2 * h * e
    if name == "d3d_flash_dkv":
        issued = b * kh * tiles * g * f * t * (2 * h * e + 8) + 4 * kv_bytes
    elif name == "d3d_flash_decode":
        issued = b * kh * tiles * kv_live + 2 * results
    else:
        issued = b * n * tiles * kv_live + once - 2 * kv_bytes
    pairs = b * n * t * s * f
    return {"flops": float(FLOPS_PER_PAIR[name] * pairs * h), "transcendentals": float(pairs), "bytes": once,
            "issued_bytes": float(max(issued, once * f)), "estimated": True}


def live_fraction(q_meta, k_meta, block_q: int = 64, block_k: int = 64) -> float:
    """Share of (query tile, key tile) pairs the kernels visit for this metadata."""
    from d3d_jax.model.flash_attention import tile_visibility

    return float(tile_visibility(q_meta, k_meta, block_q, block_k).mean())
