"""Each fused attention kernel's own cost, from the shapes of its call (XLA counts a kernel as 0).

Stated estimates, per call of ``model/flash_attention.py``'s kernels, ``q [B,T,N,H]`` over
``k, v [B,S,K,H]``:

* **flops**: every (query, key) pair of the padded call, ``c·B·N·T·S·H`` with ``c`` = 4 for the
  forward (QKᵀ and PV), 6 for dQ (QKᵀ, dO·Vᵀ, dS·K) and 8 for dK/dV (QKᵀ, dO·Vᵀ, dSᵀQ, PᵀdO).  An
  upper bound: tiles the mask hides are skipped at run time, which a compile cannot know.
* **bytes**: every operand read once and every result written once.  This is the traffic of a
  kernel whose K/V re-reads (one per query head of a GQA group, one per query tile) hit L2;
  ``issued_bytes`` is what the CTAs load without any L2 reuse: each of the grid's CTAs reads its
  query tile and the whole K/V span of its kv head.  The roofline uses ``bytes``.

Calls of other custom kernels (cuBLAS, Mosaic TPU) carry no estimate here: ``estimated`` is
False and the report lists them.
"""

from __future__ import annotations

import numpy as np

FLOPS_PER_PAIR = {"d3d_flash_fwd": 4, "d3d_flash_dq": 6, "d3d_flash_dkv": 8}


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


def estimate(call: dict) -> dict:
    """``{flops, bytes, issued_bytes, estimated}`` of one kernel call (see the module doc)."""
    name, ops, res = call["name"], call["operands"], call["results"]
    factor = FLOPS_PER_PAIR.get(name)
    if factor is None or len(ops) < 3:
        return {"flops": 0.0, "bytes": 0.0, "issued_bytes": 0.0, "estimated": False}
    (qdt, (b, t, n, h)), (kdt, kshape) = ops[0], ops[1]
    s = kshape[1]
    once = float(sum(_size(o) for o in ops) + sum(_size(r) for r in res))
    ctas = int(np.prod(call.get("grid") or [1]))
    if name == "d3d_flash_dkv":  # one CTA per (row, head, key tile): it reads every query
        per_cta = sum(_size(o) for o in ops) / max(b * n, 1)
    else:  # one CTA per (row, head, query tile): it reads the whole K/V span of its kv head
        kv = 2 * s * h * _size((kdt, (1,))) + 2 * s * 4  # keys, values, their metadata
        per_cta = kv + _size(ops[0]) / max(ctas, 1)
    issued = ctas * per_cta + sum(_size(r) for r in res)
    return {"flops": float(factor * b * n * t * s * h), "bytes": once,
            "issued_bytes": float(max(issued, once)), "estimated": True}
