"""What stages 7 and 8 measure with: the held-out suites, the evaluation settings, a drafter's
sync run against shared plain runs, and the drafting-forward latency of a drafter by depth."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from d3d_jax.io.chat import chat_prompt_ids
from d3d_jax.config.evaluation import EvalSettings
from d3d_jax.bench.evaluation import runner as R
from d3d_jax.bench.evaluation import benchmarks as B
from d3d_jax.pipeline.context import Context

MAX_PROMPT_TOKENS = 384  # the benchmark's prompts; the cache holds them, the answer and 4 blocks


def suites(p: Context) -> dict[str, list[B.Sample]]:
    """Per benchmark, ``eval_samples`` held-out prompts of at most 384 tokens, spread in length."""
    c, tok = p.cfg, p.tokenizer()
    out = {}
    for name in c.eval_benchmarks:
        samples = B.load_benchmark(name, template="plain", passage_chars=c.passage_chars)
        lengths = [len(chat_prompt_ids(tok, [{"role": "user", "content": s.turns[0]}])) for s in samples]
        keep = [i for i, n in enumerate(lengths) if n <= MAX_PROMPT_TOKENS]
        out[name] = B.select_by_length([samples[i] for i in keep], [lengths[i] for i in keep], c.eval_samples)
    return out


def async_available() -> bool:
    from d3d_jax.decoding import engine

    return "async" in engine.MODES


def eval_settings(p: Context, has_async: bool) -> EvalSettings:
    import jax

    c = p.cfg
    b = c.eval_block
    settings = EvalSettings(max_new_tokens=c.eval_max_new_tokens, block_size=b,
                              max_cache_len=MAX_PROMPT_TOKENS + c.eval_max_new_tokens
                              + 4 * max(b, c.block_size, *c.eval_compare_blocks),
                              modes=("plain", "sync", "async") if has_async else ("plain", "sync"),
                              async_options={"branch_positions": min(c.async_positions, b),
                                             "branch_fanout": c.async_fanout} if has_async else {})
    if has_async and jax.device_count() >= 2:  # spec §5: target and drafter on disjoint devices
        settings.async_options.update(target_devices=1, drafter_devices=1)
    return settings


def decode_kwargs(p: Context) -> dict:
    return dict(eos_token_ids=p.eos_ids(), mask_token_id=p.special_ids()["mask"], encode_fn=chat_prompt_ids)


def sync_against(p: Context, target, drafter, suites_: dict, settings: EvalSettings, plain_runs: dict,
                 block: int | None = None, drafter_share: bool = False) -> dict:
    """Per suite: ``drafter``'s sync summary against the shared plain runs (other drafters, other
    B), with the drafter's share of round time when asked."""
    s_set = dataclasses.replace(settings, modes=("sync",), block_size=block or settings.block_size,
                                drafter_share_samples=int(drafter_share))
    res, raw = R.evaluate(target, drafter, p.tokenizer(), suites_, s_set, **decode_kwargs(p))
    out = {}
    for s in suites_:
        out[s] = B.summarize({"plain": plain_runs[s], "sync": raw[s]["sync"]}, s_set.block_size)["sync"]
        if "drafter_share" in res[s]["sync"]:
            out[s]["drafter_share"] = res[s]["sync"]["drafter_share"]
    return out


def plain_runs(p: Context, target, suites_: dict, settings: EvalSettings) -> dict:
    """Plain greedy decoding of every suite: what every speculative output must equal."""
    s_set = dataclasses.replace(settings, modes=("plain",))
    _, raw = R.evaluate(target, None, p.tokenizer(), suites_, s_set, **decode_kwargs(p))
    return {s: raw[s]["plain"] for s in suites_}


# --------------------------------------------------------------------------------------------
# Drafting-forward latency by depth (what pruning a layer buys)
# --------------------------------------------------------------------------------------------
def forward_step(cfg, tokens: int, context: int, cache_len: int, seed: int = 0):
    """A compiled batch-1 forward of ``tokens`` tokens (``[anchor, MASK×(tokens-1)]``) over a KV
    cache holding ``context`` tokens, for a model of config ``cfg``, as a no-argument call that
    waits for its result (random weights: the cost of a forward does not depend on their values)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from d3d_jax.model.kv_cache import init_cache
    from d3d_jax.model.masks import block_meta, causal_meta
    from d3d_jax.model.qwen3 import init_model

    model = init_model(cfg, seed=seed)
    graphdef, state = nnx.split(model)
    pos = jnp.arange(context, dtype=jnp.int32)[None]
    ids = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, context)), jnp.int32)
    _, cache = jax.jit(lambda st, x, c: nnx.merge(graphdef, st)(x, causal_meta(pos), cache=c))(
        state, ids, init_cache(cfg, 1, cache_len))
    block = jnp.full((1, tokens), 1, jnp.int32)
    meta = block_meta(jnp.full((1, 1), context, jnp.int32), tokens)
    step = jax.jit(lambda st, x, c: nnx.merge(graphdef, st)(x, meta, cache=c)[0])
    run = lambda: jax.block_until_ready(step(state, block, cache))  # noqa: E731
    run()  # compile
    return run


def interleaved_ms(runs: dict, repeats: int = 40) -> dict:
    """Median ms of each call in ``runs``, timed in turn (one of each per pass), so a drift of the
    machine's speed reaches every call alike instead of whichever was timed last."""
    times = {k: [] for k in runs}
    for _ in range(repeats):
        for k, run in runs.items():
            t = time.perf_counter()
            run()
            times[k].append(time.perf_counter() - t)
    return {k: 1e3 * float(np.median(v)) for k, v in times.items()}


def drafter_latency(p: Context, depths: list[int], block: int, context: int = 320) -> dict:
    """The target-initialised drafter's drafting forward at each depth, the small drafter's, and
    the target's plain step (one token) as the unit, all over the same cache."""
    from d3d_jax.config import load_model_config

    c = p.cfg
    settings_cache = MAX_PROMPT_TOKENS + c.eval_max_new_tokens + 4 * c.block_size
    base = p.model_config(load_model_config(str(p.model_dir("target"))), mask_token_id=p.special_ids()["mask"])
    small = p.model_config(load_model_config(str(p.drafter_dir(c.eval_drafters[0]))))
    runs = {"plain": forward_step(base, 1, context, settings_cache),
            "small": forward_step(small, block, context, settings_cache)}
    runs |= {d: forward_step(dataclasses.replace(base, num_layers=d), block, context, settings_cache)
             for d in depths}
    ms = interleaved_ms(runs)
    plain, rows = ms["plain"], {d: ms[d] for d in depths}
    out = {"block": block, "context": context, "plain_step_ms": plain,
           "depth_ms": {str(d): v for d, v in rows.items()},
           "depth_in_plain_steps": {str(d): v / plain for d, v in rows.items()},
           "main_drafter": {"name": c.eval_drafters[0], "layers": small.num_layers, "hidden": small.hidden_size,
                            "ms": ms["small"]}}
    ds = sorted(rows)
    if len(ds) > 1:  # least squares: ms per layer over the measured depths
        slope = float(np.polyfit(ds, [rows[d] for d in ds], 1)[0])
        out["saving_ms_per_layer"] = slope
        out["saving_per_layer_fraction"] = slope / rows[max(ds)]
    return out
