"""The one evaluation runner: every benchmark sample, in one mode, through caller-held decoders.

A :class:`Runner` holds the generate function and how it drives the decoder, so nothing is read
off a function attribute:

* ``concurrency == 1`` (the paper's latency numbers): batch 1, sample after sample, each turn a
  call of :func:`~d3d_jax.decoding.engine.generate`; the engine's own decode time (compilation
  left out) is billed to the mode;
* ``concurrency > 1``: one long-lived decoder per mode with N requests in flight (continuous
  batching, :func:`~d3d_jax.serving.offline.generate`).  Turns run in waves, all first turns
  together, then all second turns (a later turn needs the answer to the one before); a wave's
  wall time is billed, so time per output token is that of the whole loaded decoder, which is
  what a server sees at N concurrent requests.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from d3d_jax.bench.evaluation.benchmarks import ModeRun, Sample, async_parts, summarize
from d3d_jax.config.evaluation import EvalSettings

_BRANCH_METRICS = ("hits", "misses", "hit_rate")  # a branch pack's: only async and auto rounds have one


@dataclasses.dataclass
class Runner:
    """``generate(prompts, mode) -> [GenerationOutput]`` and the way :meth:`run_mode` drives it."""

    generate: Callable
    concurrency: int = 1  # > 1: all samples in flight, in waves of turns

    def run_mode(self, tokenizer, samples: Sequence[Sample], mode: str, encode_fn: Callable) -> ModeRun:
        """Every turn of every sample in ``mode``, timed; compilation is never billed (see the module doc)."""
        if self.concurrency > 1:
            return self._in_flight(tokenizer, samples, mode, encode_fn)
        return self._batch_one(tokenizer, samples, mode, encode_fn)

    def _batch_one(self, tokenizer, samples, mode, encode_fn) -> ModeRun:
        """One untimed call per 8-token first-turn length bucket first (one program per bucket)."""
        outputs, metrics, seconds = [], [], 0.0
        seen: set[int] = set()
        for s in samples:
            ids = encode_fn(tokenizer, [{"role": "user", "content": s.turns[0]}])
            if -(-len(ids) // 8) not in seen:
                seen.add(-(-len(ids) // 8))
                self.generate([ids], mode)
        for s in samples:
            messages: list[dict] = []
            for turn in s.turns:
                messages.append({"role": "user", "content": turn})
                ids = encode_fn(tokenizer, messages)
                t0 = time.perf_counter()
                out = self.generate([ids], mode)[0]
                wall = time.perf_counter() - t0
                # The engine times decoding apart from compilation (new prompt lengths compile anew).
                seconds += float((out.metrics or {}).get("batch_wall_s", wall))
                outputs.append(list(out.token_ids))
                metrics.append(dict(out.metrics or {}))
                messages.append({"role": "assistant",
                                 "content": tokenizer.decode(out.token_ids, skip_special_tokens=True)})
        return ModeRun(mode, outputs, seconds, metrics)

    def _in_flight(self, tokenizer, samples, mode, encode_fn) -> ModeRun:
        """One untimed wave as wide as the decoder compiles first: as its requests finish, the
        rounds pass through every window width the timed waves use (one program per width)."""
        conversations: list[list[dict]] = [[] for _ in samples]
        outputs: list[list] = [[None] * len(s.turns) for s in samples]
        firsts = [encode_fn(tokenizer, [{"role": "user", "content": s.turns[0]}]) for s in samples]
        self.generate(firsts[: self.concurrency], mode)
        seconds = 0.0
        for t in range(max((len(s.turns) for s in samples), default=0)):
            idx = [i for i, s in enumerate(samples) if len(s.turns) > t]
            for i in idx:
                conversations[i].append({"role": "user", "content": samples[i].turns[t]})
            prompts = [encode_fn(tokenizer, conversations[i]) for i in idx]
            t0 = time.perf_counter()
            outs = self.generate(prompts, mode)
            seconds += time.perf_counter() - t0
            for i, out in zip(idx, outs):
                outputs[i][t] = out
                conversations[i].append({"role": "assistant",
                                         "content": tokenizer.decode(out.token_ids, skip_special_tokens=True)})
        flat = [o for per in outputs for o in per]
        drop = () if mode in ("async", "auto") else _BRANCH_METRICS
        metrics = [{k: v for k, v in (o.metrics or {}).items() if k not in drop} for o in flat]
        return ModeRun(mode, [list(o.token_ids) for o in flat], seconds, metrics)


def mode_fields(settings: EvalSettings, mode: str) -> dict:
    """The DecoderConfig fields of ``mode``'s decoder (the block size, the device split and that
    mode's options)."""
    return {"block_size": settings.block_size, **settings.device_options,
            **{"async": settings.async_options, "auto": settings.auto_options}.get(mode, {})}


def make_runner(target, drafter, settings: EvalSettings, eos_token_ids: Sequence[int],
                mask_token_id: int | None, *, extra_options: dict | None = None, decoders: dict | None = None,
                decoder_factory: Callable | None = None, request_cls=None) -> Runner:
    """The runner ``settings.concurrency`` asks for; one decoder per mode, built on first use and
    kept in ``decoders`` (callers that pass one dict share the compiled programs).
    ``decoder_factory(mode) -> decoder`` replaces the in-flight SpecDecoder (tests)."""
    decoders = {} if decoders is None else decoders
    if settings.concurrency > 1:
        return Runner(_in_flight_generate(target, drafter, settings, eos_token_ids, decoders, decoder_factory,
                                          request_cls), settings.concurrency)
    return Runner(_batch_one_generate(target, drafter, settings, eos_token_ids, mask_token_id, decoders,
                                      dict(extra_options or {})))


def _batch_one_generate(target, drafter, settings, eos_token_ids, mask_token_id, decoders, extra) -> Callable:
    from d3d_jax.bench.clock import CompileClock
    from d3d_jax.bench.phased import host_loop
    from d3d_jax.bench.timeline import AsyncTimeline
    from d3d_jax.decoding import engine

    timed = extra.pop("loop", "device") == "host"

    def fn(prompts, mode):
        key = (mode, tuple(sorted(extra.items())))
        if key not in decoders:
            decoders[key] = engine.make_decoder(
                target, None if mode == "plain" else drafter, mode=mode, num_slots=1,
                max_cache_len=settings.max_cache_len, mask_token_id=mask_token_id,
                **{**mode_fields(settings, mode), **extra})
        dec = decoders[key]
        hook = AsyncTimeline(dec.shared) if mode == "async" and settings.async_timeline else None
        return engine.generate(dec, prompts, max_new_tokens=settings.max_new_tokens,
                               eos_token_ids=tuple(eos_token_ids), hook=hook,
                               loop=host_loop(mode) if timed else None, clock=CompileClock)

    return fn


def _in_flight_generate(target, drafter, settings, eos_token_ids, decoders, decoder_factory, request_cls) -> Callable:
    from d3d_jax.serving import offline

    def build(mode):
        from d3d_jax.decoding.decoder import SpecDecoder
        from d3d_jax.decoding.decoder_config import decoder_config

        cfg = decoder_config(mode, num_slots=settings.concurrency, max_cache_len=settings.max_cache_len,
                             eos_token_ids=tuple(eos_token_ids), **mode_fields(settings, mode))
        return SpecDecoder(target, None if mode == "plain" else drafter, cfg)

    def fn(prompts, mode):
        if mode not in decoders:
            decoders[mode] = (decoder_factory or build)(mode)
        return offline.generate(decoders[mode], prompts, max_new_tokens=settings.max_new_tokens,
                                request_cls=request_cls)

    return fn


def evaluate(target, drafter, tokenizer, suites: dict[str, list[Sample]], settings: EvalSettings, *,
             eos_token_ids: Sequence[int], mask_token_id: int | None,
             encode_fn: Callable, progress: bool = True) -> tuple[dict, dict[str, dict[str, ModeRun]]]:
    """Run every suite in every mode; returns (summaries per benchmark, the raw runs).  A stacked
    model is laid out per layer once here, for every mode's decoder (they read it in place)."""
    from d3d_jax.decoding.engine import decoding_layout

    settings.validate()
    target, drafter = decoding_layout(target), decoding_layout(drafter)
    decoders: dict = {}  # the caller's decoders: one per mode, shared by every run below
    runner = make_runner(target, drafter, settings, eos_token_ids, mask_token_id, decoders=decoders)
    results, raw = {}, {}
    for name, samples in suites.items():
        runs, errors = _run_modes(runner, tokenizer, name, samples, settings.modes, encode_fn, progress)
        results[name] = summarize(runs, settings.block_size)
        if "sync" in runs and settings.drafter_share_samples and settings.concurrency == 1:
            results[name]["sync"].update(sync_drafter_share(target, drafter, tokenizer, samples, settings,
                                                            eos_token_ids, mask_token_id, encode_fn,
                                                            decoders))
        for mode, err in errors.items():
            results[name][mode] = {"error": err}
        results[name]["num_samples"] = len(samples)
        raw[name] = runs
    return results, raw


def _run_modes(runner: Runner, tokenizer, name: str, samples, modes, encode_fn, progress: bool):
    """``({mode: ModeRun}, {mode: error})``: a broken mode is reported and the others still measured."""
    runs, errors = {}, {}
    for mode in modes:
        t0 = time.perf_counter()
        try:
            runs[mode] = runner.run_mode(tokenizer, samples, mode, encode_fn)
        except Exception as e:  # report a broken mode and keep measuring the others
            if mode == "plain":
                raise
            errors[mode] = f"{type(e).__name__}: {e}"
            print(f"[eval] {name:12s} {mode:6s} FAILED: {errors[mode]}", flush=True)
            continue
        if progress:
            parts = async_parts(runs[mode].metrics)
            extra = (f", overlap {parts['overlap_fraction']:.0%} (target {parts['verify_devices']}, "
                     f"drafter {parts['packed_devices']})" if parts else "")
            print(f"[eval] {name:12s} {mode:6s} {runs[mode].new_tokens:6d} tokens "
                  f"{1e3 * runs[mode].seconds / max(runs[mode].new_tokens, 1):7.2f} ms/token "
                  f"(wall incl. compile {time.perf_counter() - t0:.1f}s){extra}", flush=True)
    return runs, errors


def sync_drafter_share(target, drafter, tokenizer, samples: Sequence[Sample], settings: EvalSettings,
                       eos_token_ids, mask_token_id, encode_fn: Callable,
                       decoders: dict | None = None) -> dict:
    """The drafter's share of a sync round: the first samples re-run with the host-driven loop,
    which waits after drafting and after verifying (the timed runs use the fused on-device loop,
    which has no such seams).  One untimed call warms up; compilation is never counted."""
    gen = make_runner(target, drafter, settings, eos_token_ids, mask_token_id,
                      extra_options={"loop": "host"}, decoders=decoders).generate
    prompts = [encode_fn(tokenizer, [{"role": "user", "content": s.turns[0]}])
               for s in samples[: settings.drafter_share_samples]]
    gen(prompts[:1], "sync")  # warm-up
    draft = verify = 0.0
    for ids in prompts:
        out = gen([ids], "sync")[0]
        draft += float(out.metrics.get("draft_s") or 0.0)
        verify += float(out.metrics.get("verify_s") or 0.0)
    total = draft + verify
    return {"drafter_share": draft / total if total > 0 else None, "host_loop_draft_s": draft,
            "host_loop_verify_s": verify}


def budget_sweep(target, drafter, tokenizer, samples: Sequence[Sample], settings: EvalSettings,
                 grid: Sequence[tuple[int, int]], plain: ModeRun, *, eos_token_ids, mask_token_id,
                 encode_fn: Callable, option_names: tuple[str, str] = ("branch_positions", "branch_fanout")) -> list[dict]:
    """Async hit rate and speedup for each (C, F); N_async = B·[(C-1)·F + 2]."""
    from d3d_jax.decoding.engine import decoding_layout

    target, drafter = decoding_layout(target), decoding_layout(drafter)  # once for every (C, F)
    out = []
    plain_tpot = plain.seconds / max(plain.new_tokens, 1)
    for c, f in grid:
        s = dataclasses.replace(settings, async_options={**settings.async_options,
                                                         option_names[0]: c, option_names[1]: f})
        run = make_runner(target, drafter, s, eos_token_ids, mask_token_id).run_mode(
            tokenizer, samples, "async", encode_fn)
        summ = summarize({"plain": plain, "async": run}, settings.block_size)["async"]
        out.append({"C": c, "F": f, "budget": settings.block_size * ((c - 1) * f + 2),
                    "hit_rate": summ.get("hit_rate"), "tau": summ.get("tau"),
                    "overlap_fraction": summ.get("overlap_fraction"), "drafter_share": summ.get("drafter_share"),
                    "speedup": plain_tpot / max(run.seconds / max(run.new_tokens, 1), 1e-12),
                    "equals_plain": summ.get("equals_plain")})
    return out
