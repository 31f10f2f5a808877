"""``generate``: plain, synchronous (spec §4) and asynchronous (spec §5) decoding of a list of
prompts, as a thin client of :class:`~d3d_jax.decoding.decoder.SpecDecoder`.

Prompts are cut into batches of ``batch_size``; each batch is prefilled into the decoder's slots
(one padded prompt length per call, so one compile serves every batch) and decoded to the end:
plain and sync rounds in one on-device ``lax.while_loop``, async rounds by a host loop that only
dispatches.  Decoders are kept between calls (keyed by model structure and config), so repeated
calls reuse their compiled methods, as a server keeps its one decoder.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Sequence

from flax import nnx

from d3d_jax.decoding import metrics as M
from d3d_jax.decoding.clock import CompileClock
from d3d_jax.decoding.core import MAX_STOP_IDS
from d3d_jax.decoding.decoder import SpecDecoder
from d3d_jax.decoding.decoder_config import (DEFAULT_BRANCH_FANOUT, DEFAULT_BRANCH_POSITIONS, MODES,
                                             DecoderConfig, Request, prompt_problem)
from d3d_jax.decoding.drafting import ModelDrafter, ReplayDrafter, as_drafter
from d3d_jax.decoding.verify import SamplingParams

__all__ = ["SamplingParams", "GenerationOutput", "generate", "summarize_outputs", "ModelDrafter",
           "ReplayDrafter", "MODES"]

_SYNC_OPTIONS = ("loop", "sample_drafts", "acceptance_rule", "acceptance_override")
_ASYNC_OPTIONS = ("branch_positions", "branch_fanout", "target_devices", "drafter_devices",
                  "timeline", "verbose", "acceptance_rule", "acceptance_override")
_DESCRIBED: set = set()


@dataclasses.dataclass
class GenerationOutput:
    token_ids: list[int]  # generated ids only
    finish_reason: str  # "eos" | "stop" | "length"
    metrics: dict


# Decoders kept between generate() calls: their compiled methods are reused; parameters and
# state are dropped after each call (a decoder in use is out of the pool: calls never share one).
_DECODERS: "collections.OrderedDict" = collections.OrderedDict()
_DECODERS_KEPT = 8


def _take_decoder(target, drafter, cfg: DecoderConfig):
    graphdef, params = nnx.split(target)  # one walk of the module graph per call
    key = (graphdef, None if drafter is None else drafter.signature, cfg)
    dec = _DECODERS.pop(key, None)
    if dec is None:
        dec = SpecDecoder(target, drafter, cfg)
    else:
        dec.load_params(params, drafter)
    return key, dec


def _return_decoder(key, dec: SpecDecoder) -> None:
    dec.unload()
    _DECODERS[key] = dec
    while len(_DECODERS) > _DECODERS_KEPT:
        _DECODERS.popitem(last=False)


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


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _cache_len(longest: int, max_new: int, block: int, max_cache_len: int | None) -> int:
    need = longest + max_new + block
    if max_cache_len is None:
        return _round_up(need, 16)
    cache_len = int(max_cache_len)
    if block > cache_len:
        raise ValueError(f"block_size {block} is larger than max_cache_len {cache_len}")
    if longest > cache_len:
        raise ValueError(f"a prompt of {longest} tokens is longer than max_cache_len {cache_len}")
    if need > cache_len:
        raise ValueError(f"max_cache_len {cache_len} is too small: the longest prompt ({longest}) "
                         f"+ max_new_tokens ({max_new}) + block_size ({block}) = {need}")
    return cache_len


def _check_ids(vocab: int, eos_token_ids, stop_token_ids) -> None:
    for name, ids in (("eos_token_ids", eos_token_ids), ("stop_token_ids", stop_token_ids)):
        for t in ids:
            if not 0 <= int(t) < vocab:
                raise ValueError(f"{name} has id {t} outside the vocabulary [0, {vocab})")
    if len(eos_token_ids) + len(stop_token_ids) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} eos + stop token ids, got "
                         f"{len(eos_token_ids) + len(stop_token_ids)}")


def _mode_config(mode: str, options: dict, block_size: int) -> tuple[dict, dict]:
    """``(DecoderConfig fields, run options)`` from generate's mode options; unknown ones fail."""
    known = _ASYNC_OPTIONS if mode == "async" else _SYNC_OPTIONS
    unknown = sorted(set(options) - set(known) - {"loop"})
    if unknown:
        kind = "async" if mode == "async" else "fused"
        raise ValueError(f"unknown mode options for {kind} decoding: {unknown}")
    loop = options.get("loop", "device")
    if loop not in ("device", "host"):
        raise ValueError(f"loop must be 'device' or 'host', got {loop!r}")
    fields = dict(acceptance_rule=options.get("acceptance_rule"),
                  acceptance_override=options.get("acceptance_override"),
                  sample_drafts=bool(options.get("sample_drafts", False)))
    if mode == "async":
        fields.update(branch_positions=int(options.get("branch_positions", DEFAULT_BRANCH_POSITIONS)),
                      branch_fanout=int(options.get("branch_fanout", DEFAULT_BRANCH_FANOUT)),
                      target_devices=options.get("target_devices"),
                      drafter_devices=options.get("drafter_devices"))
    run = dict(loop=loop, timeline=options.get("timeline"), verbose=options.get("verbose", True))
    return fields, run


def generate(target, prompts: Sequence[Sequence[int]], *, mode: str = "plain", drafter=None,
             sampling: SamplingParams = SamplingParams(), max_new_tokens: int = 128,
             eos_token_ids: Sequence[int] = (), stop_token_ids: Sequence[int] = (),
             batch_size: int | None = None, seed: int = 0, block_size: int = 16,
             mask_token_id: int | None = None, max_cache_len: int | None = None,
             row_seeds: Sequence[int] | None = None, prompt_pad_len: int | None = None,
             **mode_options) -> list[GenerationOutput]:
    """Generate for every prompt; outputs in prompt order.

    ``target``: an NNX :class:`~d3d_jax.model.qwen3.Qwen3`.  ``drafter`` (sync/async): a Qwen3
    drafter (its ``mask_token_id`` from the argument or its config) or any
    :class:`~d3d_jax.decoding.drafting.Drafter` (:class:`ModelDrafter`, :class:`ReplayDrafter`, ...).
    Mode options for plain/sync: ``loop="device"`` (fused on-device loop, default) or ``"host"``
    (per-round Python loop that also times drafting and verifying); ``sample_drafts=True``
    samples drafts from the drafter's q (sampling only) instead of its argmax;
    ``acceptance_rule=fn`` swaps the verification rule (experiments, statistical tests).  For
    async: ``branch_positions`` (C), ``branch_fanout`` (F), ``target_devices``/``drafter_devices``
    (counts or device lists), ``timeline`` (a list receiving one dict per round), ``verbose``.
    ``row_seeds`` (plain/sync): one int in [0, 2**31) per prompt; prompt i then samples with
    ``fold_in(key(seed), row_seeds[i])`` instead of ``fold_in(key(seed), i)``, so its randomness
    does not depend on which other prompts share the call (data regeneration resumes with it).
    ``prompt_pad_len`` pads prompts to that length instead of the longest rounded up to 8, so a
    caller making many calls with bucketed lengths compiles once per bucket.
    Rows of a batch share shapes: prompts are right-padded to the longest prompt of the call and
    the cache length is fixed for the call, so one compile serves every batch.
    """
    vocab = target.config.vocab_size
    prompts = _validate_call(prompts, vocab, mode, sampling, max_new_tokens, eos_token_ids,
                             stop_token_ids)
    fields, run = _mode_config(mode, mode_options, int(block_size))
    if mode == "plain":
        if drafter is not None:
            raise ValueError("mode='plain' takes no drafter")
    else:
        if drafter is None:
            raise ValueError(f"mode={mode!r} needs a drafter")
        if int(block_size) < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        drafter = as_drafter(drafter, vocab, mask_token_id)
    n = len(prompts)
    index = _row_indices(mode, row_seeds, n)
    bsz = n if batch_size is None else int(batch_size)
    if bsz < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    cache_len, pad_len = _shapes(prompts, int(max_new_tokens), int(block_size), max_cache_len,
                                 prompt_pad_len)
    cfg = DecoderConfig(mode=mode, num_slots=bsz, max_cache_len=cache_len, block_size=int(block_size),
                        **fields)
    requests = [Request(p, int(max_new_tokens), sampling, tuple(stop_token_ids), int(seed), index[i],
                        tuple(eos_token_ids)) for i, p in enumerate(prompts)]
    key, dec = _take_decoder(target, drafter, cfg)
    try:
        if mode == "async" and run["verbose"] and cfg.layout not in _DESCRIBED:
            _DESCRIBED.add(cfg.layout)  # once per layout, not once per batch
            print(cfg.layout.describe(), flush=True)
        outputs, run["sync_drafts_before"] = [], 0
        for bi, start in enumerate(range(0, n, bsz)):
            outputs += _run_batch(dec, requests[start: start + bsz], bi, pad_len, run, mode)
    finally:
        _return_decoder(key, dec)
    return outputs


def _validate_call(prompts, vocab: int, mode: str, sampling, max_new_tokens, eos_token_ids,
                   stop_token_ids) -> list[list[int]]:
    if not isinstance(sampling, SamplingParams):
        raise ValueError("sampling must be a SamplingParams")
    sampling.validate()
    if int(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompts = _validate_prompts(prompts, vocab)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {'|'.join(MODES)}, got {mode!r}")
    _check_ids(vocab, eos_token_ids, stop_token_ids)
    return prompts


def _row_indices(mode: str, row_seeds, n: int) -> list[int]:
    """Each prompt's key index: its position, or ``row_seeds[i]``."""
    if row_seeds is None:
        return list(range(n))
    if mode == "async":
        raise ValueError(f"row_seeds is supported by modes plain and sync, not {mode!r}")
    row_seeds = [int(s) for s in row_seeds]
    if len(row_seeds) != n or not all(0 <= s < 2 ** 31 for s in row_seeds):
        raise ValueError(f"row_seeds must hold one int in [0, 2**31) per prompt ({n} prompts)")
    return row_seeds


def _shapes(prompts, max_new: int, block: int, max_cache_len, prompt_pad_len) -> tuple[int, int]:
    """``(cache length, prompt pad length)`` of the call: fixed for every batch."""
    longest = max(len(p) for p in prompts)
    cache_len = _cache_len(longest, max_new, block, max_cache_len)
    if prompt_pad_len is None:
        return cache_len, _round_up(longest, 8)
    if not longest <= int(prompt_pad_len) <= cache_len:
        raise ValueError(f"prompt_pad_len {prompt_pad_len} must be in [longest prompt {longest}, "
                         f"cache length {cache_len}]")
    return cache_len, int(prompt_pad_len)


def _run_batch(dec: SpecDecoder, requests: list[Request], batch_index: int, pad_len: int,
               run: dict, mode: str) -> list[GenerationOutput]:
    slots = list(range(len(requests)))
    with CompileClock() as clock:
        t0, c0 = time.perf_counter(), time.process_time()
        rows = dec.config.num_slots  # every batch the same shape: one compile
        timings = {}
        if mode != "async" and run["loop"] == "device":
            dec.run_requests(requests, slots, pad_len, num_rows=rows)
            dec.wait()
        else:
            dec.insert_requests(requests, slots, pad_len, num_rows=rows)
            timings = (dec.run_timed() if mode != "async" else
                       dec.run_until_done(timeline=run["timeline"]))
        wall = time.perf_counter() - t0 - clock.seconds
        cpu = time.process_time() - c0 - clock.seconds
    results = dec.results(slots)
    dec.free(slots)
    batch = dict(timings.get("metrics", {}))
    if mode == "async":
        hits = sum(r["hits"] for r in results)
        judged = hits + sum(r["misses"] for r in results)
        # the device counts synchronous drafts over the decoder's life: this batch's share
        batch.update(sync_drafts=results[0]["sync_drafts"] - run["sync_drafts_before"],
                     hit_rate_batch=hits / judged if judged else float("nan"))
        run["sync_drafts_before"] = results[0]["sync_drafts"]
    outs = []
    for r in results:
        met = M.request_metrics(r["accept_hist"], len(r["token_ids"]), wall, mode=mode,
                                batch_index=batch_index, draft_s=timings.get("draft_s"),
                                verify_s=timings.get("verify_s"), cpu_s=cpu,
                                compile_s=clock.seconds)
        met.update(batch)
        if mode == "async":
            judged = r["hits"] + r["misses"]
            met.update(hits=r["hits"], misses=r["misses"],
                       hit_rate=r["hits"] / judged if judged else float("nan"))
        outs.append(GenerationOutput(r["token_ids"], r["finish_reason"], met))
    return outs


def summarize_outputs(outputs: Sequence[GenerationOutput]) -> dict:
    """Overall metrics of one :func:`generate` call (pooled τ and histogram, tokens/s, ...)."""
    return M.summarize([o.metrics for o in outputs])

