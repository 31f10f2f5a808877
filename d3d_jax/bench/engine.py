"""``infer/bench.py engine``: (a) plain decoding vs transformers' greedy ``generate`` on the same
weights; (b) engine efficiency of sync decoding with an always-right replay drafter.

Efficiency = measured speedup ÷ ideal speedup, ideal = τ · t₁ / t_B, where t₁ and t_B are the
target's one-token and B-token cached forward times measured on the device in a ``fori_loop`` (no
dispatch overhead).  An efficiency of 1 means a round costs exactly one B-token target forward and
a plain step one 1-token forward: everything else (drafting, acceptance, commit, the loop) is free.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from d3d_jax.bench import engine_compare, simulate
from d3d_jax.bench.generator import Generator
from d3d_jax.decoding.engine import ReplayDrafter
from d3d_jax.model import kv_cache as kvc
from d3d_jax.model.masks import causal_meta


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark model's shape (a 4-layer, 256-wide Qwen3), the prompt and the tokens to make."""
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--streams", type=int, default=1,
                   help="prompts decoded together as one batch (one slot each); ms/token is the batch's "
                        "time per token of one stream")
    p.add_argument("--kv-page-size", type=int, default=0,
                   help="KV cache pages of this many tokens (the server's layout); 0: one dense cache row "
                        "per slot")
    p.add_argument("--error-rate", type=float, default=0.0,
                   help="replay drafter's per-token error rate (0: always right)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--clock", choices=("wall", "cpu", "auto"), default="wall",
                   help="the clock of the headline figures (the other is reported beside them): wall, what "
                        "a user waits; cpu: process CPU time (steadier on a shared CPU host, with "
                        "infer/bench.py --cpu-threads 1); auto: cpu on a CPU backend, wall otherwise")
    p.add_argument("--compare-with", default=None, metavar="CHECKOUT",
                   help="also time another checkout's plain and sync decoding in this process (its "
                        "d3d_jax imported as d3d_jax_base), interleaved A B B A with this one's: ratios "
                        "this / base per repeat, and whether both made the same tokens")
    p.add_argument("--json-out", default=None, help="also write the JSON result here")
    simulate.add_arguments(p)


def _build_models(args):
    """Random-weight transformers Qwen3 and the same weights in our model (via an HF dir)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from d3d_jax.io.hf import load_qwen3

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                      tie_word_embeddings=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    hf = Qwen3ForCausalLM(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_qwen3(d, dtype=args.dtype, stacked=False)  # as the commands load a target
    return hf, ours




def target_step_fn(model, width: int, context_len: int, cache_len: int, iters: int = 32):
    """A callable running ``iters`` cached target forwards over ``width`` tokens after
    ``context_len`` cached ones, in one ``fori_loop`` (no dispatch overhead); blocks until done.
    The model runs unstacked, as a decoder runs it (a scanned stack would copy weight slices)."""
    from d3d_jax.model.qwen3 import unstacked

    graphdef, params = nnx.split(unstacked(model))

    @jax.jit
    def run(params, cache, ctx):
        # ctx is traced, as the engine's positions are: a constant would let XLA fold RoPE
        # tables and masks and make the step look cheaper than any real decoding step
        m = nnx.merge(graphdef, params)
        pos = ctx + jnp.arange(width, dtype=jnp.int32)[None]
        tokens = jnp.zeros((1, width), jnp.int32)

        def body(i, carry):
            cache, acc = carry
            logits, cache = m(tokens + i % 7, causal_meta(pos), cache=cache)
            # consume every logit (argmax, as decoding does): reading one would let XLA shrink
            # the LM-head matmul to that element
            return (cache.with_lengths(jnp.full((1,), ctx, jnp.int32)),
                    acc + jnp.sum(jnp.argmax(logits, axis=-1)))

        return jax.lax.fori_loop(0, iters, body, (cache, jnp.int32(0)))[1]

    ctx = jnp.int32(context_len)
    cache = kvc.init_cache(model.config, 1, cache_len).with_lengths(jnp.full((1,), context_len, jnp.int32))
    jax.block_until_ready(run(params, cache, ctx))  # compile
    return lambda: jax.block_until_ready(run(params, cache, ctx))


def _clock(args) -> str:
    return ("cpu" if jax.default_backend() == "cpu" else "wall") if args.clock == "auto" else args.clock


def _header(args, clock: str, sim) -> dict:
    import torch

    return {"config": {k: v for k, v in vars(args).items() if k not in ("func", "json_out")},
            "load_avg_1m": os.getloadavg()[0], "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "device": str(jax.devices()[0]), "simulated_acceptance": simulate.record(sim),
            "timing": f"{clock} clock ({'cpu' if clock == 'wall' else 'wall'} beside it), minimum over "
                      f"{args.repeats} interleaved repeats"}


def _interleaved(measures: dict, repeats: int) -> dict:
    """``{"wall": {measure: [s, ...]}, "cpu": {...}}``: every repeat of each measure (a callable
    returning ``(wall s, CPU s)``), interleaved so that every measure sees the same machine load;
    odd repeats run in reverse order, so neighbouring measures run A B B A."""
    samples = {c: {k: [] for k in measures} for c in ("wall", "cpu")}
    for i in range(repeats):
        for k in (list(measures) if i % 2 == 0 else list(reversed(measures))):
            for c, seconds in zip(("wall", "cpu"), measures[k]()):
                samples[c][k].append(seconds)
    return samples


def _best_of_interleaved(measures: dict, repeats: int) -> dict:
    """``{"wall": {measure: s}, "cpu": {...}}``: the minimum of each measure over ``repeats``
    interleaved rounds (:func:`_interleaved`)."""
    return {c: {k: min(v) for k, v in by.items()} for c, by in _interleaved(measures, repeats).items()}


def _measures(args, hf, target, prompts, sim_kw: dict):
    """``(measures, plain outputs, sync outputs, transformers tokens or None)``: every timed
    callable (returning wall and CPU seconds), compiled (and run once) here.  All ``prompts`` are
    decoded together, one slot each."""
    import torch

    n_new, bs = args.max_new_tokens, args.block_size
    cache_len = -(-(args.prompt_len + n_new + bs) // 16) * 16  # one cache length for every run
    generate = Generator()
    paging = {"kv_page_size": args.kv_page_size} if args.kv_page_size else {}  # older code lacks the field

    def decode(n=n_new, **kw):
        return generate(target, prompts, max_new_tokens=n, block_size=bs, max_cache_len=cache_len,
                        **paging, **kw)

    plain_out = decode()  # compiles
    drafter = ReplayDrafter([o.token_ids for o in plain_out], args.vocab, error_rate=args.error_rate)
    sync_out = decode(mode="sync", drafter=drafter, **sim_kw)
    ctx = args.prompt_len + n_new // 2  # a representative context: halfway through the output
    iters_1, iters_b = 128, 32  # comparable durations, long enough for a steady minimum
    step_1 = target_step_fn(target, 1, ctx, cache_len, iters_1)
    step_b = target_step_fn(target, bs, ctx, cache_len, iters_b)
    ids = torch.tensor(prompts)  # equal lengths: no padding

    def hf_generate():
        with torch.no_grad():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=n_new, min_new_tokens=n_new, eos_token_id=None,
                               pad_token_id=0)

    def timed(fn, n=1):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n

    measures = {
        "plain": lambda: both(decode()),
        "plain_1_token": lambda: both(decode(1)),  # prefill + one step
        "sync": lambda: both(decode(mode="sync", drafter=drafter, **sim_kw)),
        "t1": lambda: timed(step_1, iters_1),
        "tB": lambda: timed(step_b, iters_b),
    }
    hf_tokens = None
    if not args.skip_transformers:
        hf_tokens = hf_generate()[:, args.prompt_len:].tolist()
        measures["transformers"] = lambda: timed(hf_generate)
    return measures, plain_out, sync_out, hf_tokens


def both(outs) -> tuple[float, float]:
    """A batch's (wall s, CPU s), as the engine measured it."""
    return outs[0].metrics["batch_wall_s"], outs[0].metrics["batch_cpu_s"]


def _plain_vs_transformers(best: dict, other: dict, n_new: int, hf_tokens, plain_out) -> dict:
    """(a) plain decoding against transformers' greedy generate (``other``: the other clock's)."""
    a = {"ours_ms_per_token": 1e3 * best["plain"] / n_new,
         "ours_ms_per_token_other_clock": 1e3 * other["plain"] / n_new}
    if hf_tokens is not None:
        a.update(transformers_ms_per_token=1e3 * best["transformers"] / n_new,
                 transformers_ms_per_token_other_clock=1e3 * other["transformers"] / n_new,
                 speedup_other_clock=other["transformers"] / other["plain"],
                 speedup=best["transformers"] / best["plain"],
                 same_tokens=hf_tokens == [o.token_ids for o in plain_out], goal=2.5)
    return a


def _sync_efficiency(best: dict, args, sim, sync_out, plain_out) -> dict:
    """(b) sync decoding with a replay drafter: efficiency against τ · t₁ / t_B."""
    n_new, bs = args.max_new_tokens, args.block_size
    # the batch runs until its slowest stream is done: its rounds set the time
    tau = float(np.mean([o.metrics["tau"] for o in sync_out]))
    rounds = max(o.metrics["rounds"] for o in sync_out)
    ideal = tau * best["t1"] / best["tB"]
    speedup = best["plain"] / best["sync"]
    # τ·t₁/t_B models decoding rounds only; with 128 tokens at τ = 16 there are 8 rounds, and the
    # prompt's prefill (shared by both modes, ≈ a round or two) weighs on the sync time.  The
    # decode-phase figures subtract it (prefill ≈ plain time for 1 token − t₁).
    prefill = max(best["plain_1_token"] - best["t1"], 0.0)
    decode_speedup = (best["plain"] - prefill) / (best["sync"] - prefill)
    return {
        "streams": args.streams, "block_size": bs, "error_rate": args.error_rate, "tau": tau,
        "rounds": rounds,
        # simulated acceptance ignores token values: its output is not comparable
        "same_tokens_as_plain": None if sim else [o.token_ids for o in sync_out] == [o.token_ids for o in plain_out],
        "plain_ms_per_token": 1e3 * best["plain"] / n_new, "sync_ms_per_token": 1e3 * best["sync"] / n_new,
        "t1_ms": 1e3 * best["t1"], "tB_ms": 1e3 * best["tB"], "ideal_speedup": ideal,
        "speedup": speedup, "efficiency": speedup / ideal, "goal": 0.85,
        "prefill_ms": 1e3 * prefill, "decode_speedup": decode_speedup,
        "decode_efficiency": decode_speedup / ideal,
        # where time goes: plain time per token ÷ t₁, sync time per round ÷ t_B (prefill excluded)
        "plain_token_over_t1": (best["plain"] - prefill) / n_new / best["t1"],
        "sync_round_over_tB": (best["sync"] - prefill) / rounds / best["tB"],
    }


def run(args) -> dict:
    sim = simulate.from_args(args, hits=False)  # bad flags fail here, before any work
    if sim is not None:
        sim.check_block(args.block_size)
    if args.streams < 1:
        raise ValueError(f"--streams must be >= 1, got {args.streams}")
    base = engine_compare.load_base(args.compare_with) if args.compare_with else None
    clock = _clock(args)
    hf, target = _build_models(args)
    prompts = np.random.default_rng(0).integers(0, args.vocab, (args.streams, args.prompt_len)).tolist()
    result = _header(args, clock, sim)
    measures, plain_out, sync_out, hf_tokens = _measures(
        args, hf, target, prompts, {} if sim is None else {"acceptance_override": sim})
    if base is not None:
        extra, *base_outs, record = engine_compare.base_measures(
            args, base, hf, prompts, [o.token_ids for o in plain_out], both)
        measures = engine_compare.paired(measures, extra)
    samples = _interleaved(measures, args.repeats)
    clocks = {c: {k: min(v) for k, v in by.items()} for c, by in samples.items()}
    best, other = clocks[clock], clocks["cpu" if clock == "wall" else "wall"]
    result["plain_vs_transformers"] = _plain_vs_transformers(best, other, args.max_new_tokens, hf_tokens,
                                                             plain_out)
    result["sync_efficiency"] = _sync_efficiency(best, args, sim, sync_out, plain_out)
    if base is not None:
        result["compare"] = engine_compare.report(
            samples, clock, args.max_new_tokens, {"plain": plain_out, "sync": sync_out},
            dict(zip(("plain", "sync"), base_outs)), record)
    return result


def format_table(result: dict) -> str:
    a, b = result["plain_vs_transformers"], result["sync_efficiency"]
    other = "CPU" if result["timing"].startswith("wall") else "wall"
    rows = [("acceptance", simulate.header(result["simulated_acceptance"])),
            ("streams decoded together (ms/token: per stream)", str(b["streams"])),
            (f"(a) ours plain, ms/token ({other})", f"{a['ours_ms_per_token']:.3f} ({a['ours_ms_per_token_other_clock']:.3f})")]
    if "transformers_ms_per_token" in a:
        rows += [(f"(a) transformers greedy, ms/token ({other})",
                  f"{a['transformers_ms_per_token']:.3f} ({a['transformers_ms_per_token_other_clock']:.3f})"),
                 (f"(a) speedup (goal >= 2.5x) ({other})", f"{a['speedup']:.2f}x ({a['speedup_other_clock']:.2f}x)"),
                 ("(a) identical tokens", str(a["same_tokens"]))]
    rows += [("(b) tau (replay drafter)", f"{b['tau']:.2f}"),
             ("(b) t1 / tB, ms", f"{b['t1_ms']:.3f} / {b['tB_ms']:.3f}"),
             ("(b) plain / sync, ms/token", f"{b['plain_ms_per_token']:.3f} / {b['sync_ms_per_token']:.3f}"),
             ("(b) ideal speedup tau*t1/tB", f"{b['ideal_speedup']:.2f}x"),
             ("(b) speedup: end to end / decode phase",
              f"{b['speedup']:.2f}x / {b['decode_speedup']:.2f}x (prefill {b['prefill_ms']:.2f} ms)"),
             ("(b) efficiency: end to end / decode phase (goal >= 0.85)",
              f"{b['efficiency']:.3f} / {b['decode_efficiency']:.3f}"),
             ("(b) plain token / t1, sync round / tB (decode phase)",
              f"{b['plain_token_over_t1']:.2f} / {b['sync_round_over_tB']:.2f}"),
             ("(b) identical tokens", "n/a (simulated acceptance)" if b["same_tokens_as_plain"] is None
              else str(b["same_tokens_as_plain"])),
             *(engine_compare.table_rows(result["compare"]) if "compare" in result else []),
             ("timing", result["timing"]),
             ("load average (1 min) / cpus", f"{result['load_avg_1m']:.1f} / {result['cpu_count']}")]
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def main(args) -> dict:
    result = run(args)
    print(json.dumps(result, indent=2))
    print(format_table(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return result
