"""``generate``: many prompts through a :class:`~d3d_jax.decoding.decoder.SpecDecoder` the caller
holds (plain, sync (spec §4), async (spec §5) or auto), batch by batch.

    dec = make_decoder(target, drafter, mode="sync", num_slots=8, max_cache_len=1024)
    outs = generate(dec, prompts, max_new_tokens=128)     # call again: nothing recompiles

Prompts are cut into batches of the decoder's ``num_slots``; each batch is admitted (one
dispatch) and decoded to the end: plain and sync rounds in one on-device ``lax.while_loop``,
async rounds by a host loop that only dispatches, auto by rounds it picks one at a time.  The
caller keeps the decoder (and so its compiled programs) for as long as it generates.

:func:`generate_stream` batches continuously instead: every prompt queued, the on-device loop run
until a few rows finish, their outputs handed out and the next prompts admitted into those rows.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Callable, Iterator, Sequence

from d3d_jax.config.decoding import DEFAULT_BLOCK_SIZE, MODES
from d3d_jax.decoding import metrics as M
from d3d_jax.decoding.core import MAX_STOP_IDS
from d3d_jax.decoding.decoder import SpecDecoder, running_slots
from d3d_jax.decoding.decoder_config import DecoderConfig, Request, decoder_config, prompt_problem
from d3d_jax.decoding.drafting import ModelDrafter, ReplayDrafter, as_drafter
from d3d_jax.decoding.verify import SamplingParams

__all__ = ["SamplingParams", "GenerationOutput", "generate", "generate_stream", "make_decoder", "cache_len_for",
           "decoding_layout",
           "summarize_outputs", "ModelDrafter", "ReplayDrafter", "MODES"]


@dataclasses.dataclass
class GenerationOutput:
    token_ids: list[int]  # generated ids only
    finish_reason: str  # "eos" | "stop" | "length"
    metrics: dict


def decoding_layout(model):
    """``model`` laid out as decoders run it fastest: a stacked Qwen3 becomes one module per layer
    (a copy of its weights, made here by the caller's choice: a decoder never copies); an
    unstacked model, a non-model drafter or None as given."""
    from d3d_jax.model.qwen3 import Qwen3, unstacked

    return unstacked(model) if isinstance(model, Qwen3) else model


def make_decoder(target, drafter=None, *, mode: str = "plain", num_slots: int = 1,
                 max_cache_len: int, block_size: int | None = None, mask_token_id: int | None = None,
                 program_dir: str | None = None, **fields) -> SpecDecoder:
    """A decoder for :func:`generate`.  ``drafter`` (modes other than plain): a Qwen3 drafter (its
    ``mask_token_id`` from the argument or its config) or any
    :class:`~d3d_jax.decoding.drafting.Drafter`.  ``fields``: more
    :class:`~d3d_jax.decoding.decoder_config.DecoderConfig` fields (``branch_positions``,
    ``sample_drafts``, ``acceptance_rule``, ...; None is derived, as ``block_size``).
    ``program_dir``: keep the compiled programs there across processes
    (:mod:`d3d_jax.compile_cache`).  The decoder checks the mode against the drafter."""
    if drafter is not None:
        drafter = as_drafter(drafter, target.config.vocab_size, mask_token_id)
    known = {f.name for f in dataclasses.fields(DecoderConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown decoder options: {unknown} (DecoderConfig fields: {sorted(known)})")
    cfg = decoder_config(mode, num_slots=int(num_slots), max_cache_len=int(max_cache_len),
                         block_size=block_size, **fields)
    return SpecDecoder(target, drafter, cfg, program_dir=program_dir)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def cache_len_for(prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE,
                  max_cache_len: int | None = None) -> int:
    """The cache length a call needs (the longest prompt + max_new_tokens + a block, rounded up
    to 16), or ``max_cache_len`` checked against it."""
    longest = max((len(p) for p in prompts), default=0)
    need = longest + int(max_new_tokens) + int(block_size)
    if max_cache_len is None:
        return _round_up(need, 16)
    cache_len = int(max_cache_len)
    if block_size > cache_len:
        raise ValueError(f"block_size {block_size} is larger than max_cache_len {cache_len}")
    if longest > cache_len:
        raise ValueError(f"a prompt of {longest} tokens is longer than max_cache_len {cache_len}")
    if need > cache_len:
        raise ValueError(f"max_cache_len {cache_len} is too small: the longest prompt ({longest}) "
                         f"+ max_new_tokens ({max_new_tokens}) + block_size ({block_size}) = {need}")
    return cache_len


def _validate_prompts(prompts, vocab: int) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of token-id lists")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: nothing to generate")
    for i, p in enumerate(prompts):
        problem = prompt_problem(p, vocab, f"prompt {i}")
        if problem:
            raise ValueError(problem)
    return [[int(t) for t in p] for p in prompts]


def _check_call(dec: SpecDecoder, prompts, sampling, max_new_tokens, eos_token_ids,
                stop_token_ids, row_seeds) -> list[list[int]]:
    if not isinstance(dec, SpecDecoder):
        raise ValueError(f"generate takes a SpecDecoder (make_decoder), got {type(dec).__name__}")
    if not isinstance(sampling, SamplingParams):
        raise ValueError("sampling must be a SamplingParams")
    sampling.validate()
    if int(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompts = _validate_prompts(prompts, dec.vocab_size)
    for name, ids in (("eos_token_ids", eos_token_ids), ("stop_token_ids", stop_token_ids)):
        for t in ids:
            if not 0 <= int(t) < dec.vocab_size:
                raise ValueError(f"{name} has id {t} outside the vocabulary [0, {dec.vocab_size})")
    if len(eos_token_ids) + len(stop_token_ids) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} eos + stop token ids, got "
                         f"{len(eos_token_ids) + len(stop_token_ids)}")
    cache_len_for(prompts, max_new_tokens, dec.config.block_size, dec.config.max_cache_len)
    if row_seeds is not None:
        row_seeds = [int(s) for s in row_seeds]
        if len(row_seeds) != len(prompts) or not all(0 <= s < 2 ** 31 for s in row_seeds):
            raise ValueError(f"row_seeds must hold one int in [0, 2**31) per prompt "
                             f"({len(prompts)} prompts)")
    return prompts


def _requests(dec: SpecDecoder, prompts, sampling, max_new_tokens, eos_token_ids, stop_token_ids, seed,
              row_seeds) -> list[Request]:
    """The call's checked prompts as requests; prompt i's key is ``fold_in(key(seed), row_seeds[i])``
    (default: ``i``)."""
    prompts = _check_call(dec, prompts, sampling, max_new_tokens, eos_token_ids, stop_token_ids, row_seeds)
    index = list(range(len(prompts))) if row_seeds is None else [int(s) for s in row_seeds]
    return [Request(p, int(max_new_tokens), sampling, tuple(stop_token_ids), int(seed), index[i],
                    tuple(eos_token_ids)) for i, p in enumerate(prompts)]


def generate(decoder: SpecDecoder, prompts: Sequence[Sequence[int]], *,
             sampling: SamplingParams = SamplingParams(), max_new_tokens: int = 128,
             eos_token_ids: Sequence[int] = (), stop_token_ids: Sequence[int] = (),
             seed: int = 0, row_seeds: Sequence[int] | None = None, hook: Callable | None = None,
             loop: Callable | None = None, clock: Callable | None = None) -> list[GenerationOutput]:
    """Generate for every prompt with ``decoder``; outputs in prompt order.

    ``row_seeds``: one int in [0, 2**31) per prompt; prompt i then samples with
    ``fold_in(key(seed), row_seeds[i])`` instead of ``fold_in(key(seed), i)``, so its randomness
    does not depend on which other prompts share the call (data regeneration resumes with it).
    ``hook`` (async): sees every round's device arrays; a hook with ``finish()`` adds what it
    returns to each batch's metrics (``d3d_jax.bench.timeline.AsyncTimeline``).  ``loop``
    (plain/sync): drives each batch's rounds instead of the on-device loop
    (:meth:`SpecDecoder.run_until_done`; ``d3d_jax.bench.phased`` times drafting and verifying
    apart).  ``clock``: a context manager factory whose
    ``.seconds`` is compile time to leave out of the decode time
    (``d3d_jax.bench.clock.CompileClock``)."""
    requests = _requests(decoder, prompts, sampling, max_new_tokens, eos_token_ids, stop_token_ids, seed,
                         row_seeds)
    decoder.free(range(decoder.config.num_slots))  # a failed earlier call may have left some
    bsz, outputs, sync_before = decoder.config.num_slots, [], [0]
    for bi, start in enumerate(range(0, len(requests), bsz)):
        outputs += _run_batch(decoder, requests[start: start + bsz], bi, hook, loop, clock,
                              sync_before)
    return outputs


# A narrower window is one more loop program (7-9 s to compile for the demo target on a CPU); it
# pays only where it drops many rows from every round (48 -> 8 rows, not 8 -> 2: a CPU round's
# cost grows slowly with its rows, so the last rows' few hundred rounds saved less than that)
NARROW_MIN_ROWS = 16


def tail_floor(buckets: Sequence[int], running: int, window: int) -> int:
    """With no prompt waiting and ``running`` rows in a ``window``-row loop: the loop stops once no
    more rows than this run, and the rest move to a window this wide; 0 runs them to the end
    where they are.  A narrower window is taken once its rows fit a quarter of it, and only if
    it is at least ``NARROW_MIN_ROWS`` rows narrower (a round costs every row of its window,
    finished or not)."""
    return max([b for b in buckets if b <= running // 4 and window - b >= NARROW_MIN_ROWS], default=0)


def generate_stream(decoder: SpecDecoder, prompts: Sequence[Sequence[int]], *,
                    sampling: SamplingParams = SamplingParams(), max_new_tokens: int = 128,
                    eos_token_ids: Sequence[int] = (), stop_token_ids: Sequence[int] = (),
                    seed: int = 0, row_seeds: Sequence[int] | None = None,
                    refill: int | None = None) -> Iterator[list[tuple[int, GenerationOutput]]]:
    """Continuous batching: yields ``[(prompt index, output), ...]`` as rows finish.

    Every prompt is queued; the decoder's slots take the first ones, and its on-device loop runs
    until ``refill`` rows (default: an eighth of the slots, at least 1) have finished.  Those
    rows' outputs are yielded and the next prompts admitted into them, so no row idles behind a
    batch's longest response.  Once no prompt waits, the last rows move to narrower windows of
    the decoder's row buckets as they thin out, where that drops enough rows
    (:func:`tail_floor`).  Arguments as :func:`generate`;
    ``row_seeds`` keep each prompt's samples independent of which rows it shared.  A plain or
    sync decoder (async runs each loop to its end: it still finishes, with fewer refills)."""
    requests = _requests(decoder, prompts, sampling, max_new_tokens, eos_token_ids, stop_token_ids, seed,
                         row_seeds)
    slots = decoder.config.num_slots
    refill = max(1, slots // 8) if refill is None else int(refill)
    if refill < 1:
        raise ValueError(f"refill must be >= 1, got {refill}")
    decoder.free(range(slots))  # a failed earlier call may have left some
    waiting, held = collections.deque(range(len(requests))), {}  # held: slot -> prompt index
    width = slots  # the loop's window: kept when rows finish, so that no width compiles unasked
    while waiting or held:
        free = [s for s in range(slots) if s not in held][: len(waiting)]
        if free:
            taken = [waiting.popleft() for _ in free]
            decoder.insert(decoder.prefill([requests[i] for i in taken]), free)
            held.update(zip(free, taken))
        t0 = time.perf_counter()
        floor = max(len(held) - refill, 0) if waiting else tail_floor(decoder.config.buckets, len(held), width)
        decoder.run_until_done(live_floor=floor, min_window=width)
        width = width if waiting or not floor else floor
        running = set(running_slots(decoder))
        finished = [s for s in sorted(held) if s not in running]
        results = decoder.results(finished) if finished else []
        decoder.free(finished)
        wall = time.perf_counter() - t0
        yield [(held.pop(s), _output(r, decoder.config.mode, 0, wall, None, 0.0, {}, {}))
               for s, r in zip(finished, results)]


def _run_batch(dec: SpecDecoder, requests: list[Request], batch_index: int, hook, loop, clock,
               sync_before: list) -> list[GenerationOutput]:
    slots = list(range(len(requests)))
    with (clock() if clock is not None else contextlib.nullcontext()) as clk:
        t0, c0 = time.perf_counter(), time.process_time()
        dec.insert(dec.prefill(requests), slots)
        timings = dec.run_until_done(hook=hook, loop=loop)
        compile_s = getattr(clk, "seconds", 0.0)
        wall = time.perf_counter() - t0 - compile_s
        # compile time is known in wall seconds only (JAX reports spans), and a compile's CPU time
        # is not its wall time (XLA's threads, waits for the disk or a busy host): taking one from
        # the other gave negative CPU times, so a batch that compiled has none
        cpu = time.process_time() - c0 if not compile_s else None
    if hasattr(hook, "finish"):  # a timeline: its per-round means join the batch's metrics
        timings = dict(timings, **hook.finish())
    results = dec.results(slots)
    dec.free(slots)
    batch = dict(timings)
    if "hits" in results[0]:
        hits = sum(r["hits"] for r in results)
        judged = hits + sum(r["misses"] for r in results)
        # the device counts synchronous drafts over the decoder's life: this batch's share
        batch.update(sync_drafts=results[0]["sync_drafts"] - sync_before[0],
                     hit_rate_batch=hits / judged if judged else float("nan"))
        sync_before[0] = results[0]["sync_drafts"]
    return [_output(r, dec.config.mode, batch_index, wall, cpu, compile_s, timings, batch)
            for r in results]


def _output(r: dict, mode: str, batch_index: int, wall: float, cpu: float | None, compile_s: float,
            timings: dict, batch: dict) -> GenerationOutput:
    met = M.request_metrics(r["accept_hist"], len(r["token_ids"]), wall, mode=mode,
                            batch_index=batch_index, draft_s=timings.get("draft_s"),
                            verify_s=timings.get("verify_s"), cpu_s=cpu, compile_s=compile_s)
    met.update(batch)
    if r.get("modes"):
        met["modes"] = dict(r["modes"])
    if r.get("reasons"):  # auto: each row-round's reason (decoding/auto_reasons.py)
        met["reasons"] = dict(r["reasons"])
    if "hits" in r:
        judged = r["hits"] + r["misses"]
        met.update(hits=r["hits"], misses=r["misses"],
                   hit_rate=r["hits"] / judged if judged else float("nan"))
    return GenerationOutput(r["token_ids"], r["finish_reason"], met)


def summarize_outputs(outputs: Sequence[GenerationOutput]) -> dict:
    """Overall metrics of one :func:`generate` call (pooled τ and histogram, tokens/s, ...)."""
    return M.summarize([o.metrics for o in outputs])
