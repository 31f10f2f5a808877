"""``infer/bench.py engine --compare-with CHECKOUT``: the other checkout's plain and sync decoding
in this process, timed among this checkout's measures.

Fresh processes of the same code spread by 15-25 % on a shared CPU, so a few-percent question
between two checkouts is only settled inside one process, with the two sides interleaved
(A B B A) so that they see the same drift of the load.  The other checkout's ``d3d_jax`` is
imported as ``d3d_jax_base`` (:mod:`d3d_jax.bench.checkout`) and runs its own loader, engine,
decoder and model; only this harness (prompts, weights file, replay tokens, timing) is shared.
Both sides load the same random weights from one saved HF directory, decode the same prompts,
and replay the same drafter tokens (this checkout's plain output).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import tempfile

from d3d_jax.bench.checkout import checkout_root, import_checkout, submodule
from d3d_jax.errors import UsageError

MEASURES = ("plain", "sync")  # the base side's measures, named "base_<measure>"


def load_base(path: str):
    """The other checkout's package (one clear error when ``path`` is not a checkout)."""
    return import_checkout(path)


def _decoder_fields(base) -> set[str]:
    return {f.name for f in dataclasses.fields(submodule(base, "decoding.decoder").DecoderConfig)}


def base_options(args, base) -> tuple[dict, list[str]]:
    """``(decoder options for the base side, names left out)``: only what that side's decoder
    accepts; an option asked for (not its default) that it lacks is an error, not a silent drop."""
    wanted = {"kv_page_size": args.kv_page_size}
    known = _decoder_fields(base)
    missing = sorted(k for k, v in wanted.items() if k not in known and v)
    if missing:
        raise UsageError(f"--compare-with: the checkout {args.compare_with} has no decoder option "
                         f"{', '.join(missing)}; run without it")
    return ({k: v for k, v in wanted.items() if k in known and v},
            sorted(k for k in wanted if k not in known))


def _base_target(base, hf, dtype: str):
    """The same weights in the base side's model, through its own HF loader."""
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        return submodule(base, "io.hf").load_qwen3(d, dtype=dtype, stacked=False)


def base_measures(args, base, hf, prompts, plain_tokens, both) -> tuple[dict, list, list, dict]:
    """``(measures, plain outputs, sync outputs, record)`` of the base side, compiled (and run once)
    here; ``plain_tokens``: the replay drafter's tokens, this side's plain output."""
    options, left_out = base_options(args, base)
    sim = submodule(base, "bench.simulate").from_args(args, hits=False)
    sim_kw = {} if sim is None else {"acceptance_override": sim}
    target = _base_target(base, hf, args.dtype)
    generate = submodule(base, "bench.generator").Generator()
    n_new, bs = args.max_new_tokens, args.block_size
    cache_len = -(-(args.prompt_len + n_new + bs) // 16) * 16  # as this side's runs

    def decode(**kw):
        return generate(target, prompts, max_new_tokens=n_new, block_size=bs, max_cache_len=cache_len,
                        **options, **kw)

    drafter = submodule(base, "decoding.engine").ReplayDrafter(plain_tokens, args.vocab,
                                                               error_rate=args.error_rate)
    plain_out, sync_out = decode(), decode(mode="sync", drafter=drafter, **sim_kw)  # compile
    measures = {"base_plain": lambda: both(decode()),
                "base_sync": lambda: both(decode(mode="sync", drafter=drafter, **sim_kw))}
    record = {"checkout": str(checkout_root(args.compare_with)), "decoder_options_passed": options,
              "decoder_options_it_lacks": left_out}
    return measures, plain_out, sync_out, record


def paired(measures: dict, base: dict) -> dict:
    """``measures`` with each base measure right after its counterpart, so that a repeat run in
    reverse order makes every pair A B B A."""
    out = {}
    for k, fn in measures.items():
        out[k] = fn
        if f"base_{k}" in base:
            out[f"base_{k}"] = base[f"base_{k}"]
    return out


def median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median (order statistics, binomial tails): the sorted
    samples k and n-1-k, k the largest with P(Binomial(n, 1/2) < k+1) <= (1 - level) / 2."""
    xs, n = sorted(xs), len(xs)
    k, tail = -1, 0.0
    while k + 1 < n // 2:
        tail += math.comb(n, k + 1) / 2 ** n
        if tail > (1 - level) / 2:
            break
        k += 1
    k = max(k, 0)  # too few samples for the level: the full range
    return xs[k], xs[n - 1 - k]


def _ratios(new: list[float], old: list[float]) -> dict:
    r = [a / b for a, b in zip(new, old)]
    lo, hi = median_interval(r)
    return {"min": min(r), "median": statistics.median(r), "max": max(r), "median_95": [lo, hi],
            "of_minima": min(new) / min(old), "repeats": len(r), "per_repeat": r}


def report(samples: dict, clock: str, n_new: int, outs: dict, base_outs: dict, record: dict) -> dict:
    """Per measure: ms/token of each side (minimum over repeats) and the ratio new / base per
    repeat (min, median, max, and the ratio of the two minima), on both clocks; and whether the
    two sides made the same tokens."""
    other = "cpu" if clock == "wall" else "wall"
    res = dict(record, clock=clock)
    for m in MEASURES:
        s, o = samples[clock], samples[other]
        res[m] = {"ms_per_token": 1e3 * min(s[m]) / n_new, "base_ms_per_token": 1e3 * min(s[f"base_{m}"]) / n_new,
                  "ratio": _ratios(s[m], s[f"base_{m}"]),
                  f"ratio_{other}_clock": _ratios(o[m], o[f"base_{m}"]),
                  "same_tokens": [x.token_ids for x in outs[m]] == [x.token_ids for x in base_outs[m]]}
    return res


def table_rows(c: dict) -> list[tuple[str, str]]:
    rows = [("(c) compared with", c["checkout"])]
    for m in MEASURES:
        r = c[m]["ratio"]
        rows += [(f"(c) {m}: ms/token this / base ({c['clock']})",
                  f"{c[m]['ms_per_token']:.3f} / {c[m]['base_ms_per_token']:.3f}"),
                 (f"(c) {m}: this / base per repeat: median (95 % interval) [min, max]; of minima",
                  f"{r['median']:.3f} ({r['median_95'][0]:.3f}-{r['median_95'][1]:.3f}) "
                  f"[{r['min']:.3f}, {r['max']:.3f}]; {r['of_minima']:.3f}"),
                 (f"(c) {m}: identical tokens", str(c[m]["same_tokens"]))]
    if c["decoder_options_it_lacks"]:
        rows.append(("(c) base lacks (not passed)", ", ".join(c["decoder_options_it_lacks"])))
    return rows
