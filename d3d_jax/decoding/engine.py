"""Decoding engine: plain decoding and synchronous speculative decoding (spec §4).

Both modes are the same round on fixed shapes.  A round feeds the target ``[anchor, d_1 … d_{W-1}]``
at positions ``s … s+W-1`` (``W = 1`` for plain decoding: no drafts), a rule from
:mod:`~d3d_jax.decoding.verify` returns ``(accepted, next_token)``, and :func:`commit` writes the
accepted drafts plus the target's token, cut at the first EOS/stop token and at
``max_new_tokens`` exactly where one-token-at-a-time decoding would cut.  Rows are padded to one
batch size; finished rows keep computing but commit nothing (masks, not branches).

Caches follow the model's convention: the target cache holds positions ``< s`` (``lengths = s``),
the anchor at ``s`` is committed but fed next round.  Prefill therefore caches the prompt minus its
last token, which becomes the first anchor (a round then decides the first generated token too).

Jitted pieces (the static config :class:`DecodeStatic` is hashable; models enter as NNX graphdef
+ state): :func:`prefill_step`, :func:`draft_step`, :func:`verify_step`, :func:`commit_step`
for host-driven loops (the async mode, per-phase timing) and :func:`decode_fused`, prefill plus a
``lax.while_loop`` over rounds that stays on the device.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from d3d_jax.decoding import metrics as M
from d3d_jax.decoding import verify as V
from d3d_jax.decoding.drafting import DraftOutput, ModelDrafter, ReplayDrafter
from d3d_jax.decoding.verify import SamplingParams
from d3d_jax.model import kv_cache as kvc
from d3d_jax.model.masks import causal_meta

__all__ = ["SamplingParams", "GenerationOutput", "DecodeStatic", "DecodeState", "generate",
           "summarize_outputs",
           "ModelDrafter", "ReplayDrafter", "register_mode", "FINISH_REASONS"]

# CPU backends cannot donate; the warning says nothing useful there.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

RUNNING, FINISH_EOS, FINISH_STOP, FINISH_LENGTH = 0, 1, 2, 3
FINISH_REASONS = {FINISH_EOS: "eos", FINISH_STOP: "stop", FINISH_LENGTH: "length"}


@dataclasses.dataclass
class GenerationOutput:
    token_ids: list[int]  # generated ids only
    finish_reason: str  # "eos" | "stop" | "length"
    metrics: dict


@dataclasses.dataclass(frozen=True)
class DecodeStatic:
    """Everything static about a decode: recompiles happen only when this or a shape changes."""

    target_graphdef: Any
    drafter_spec: Any  # None for plain decoding
    sampling: SamplingParams
    width: int  # tokens fed to the target per round: 1 (plain) or the block size B
    cache_len: int
    sample_drafts: bool = False
    rule: Callable | None = None  # acceptance rule; None = verify.default_rule(sample_drafts)

    @property
    def acceptance_rule(self) -> Callable:
        return self.rule or V.default_rule(self.sample_drafts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    target_cache: kvc.KVCache  # lengths = anchor_pos
    drafter_state: Any  # drafter's cache (model) or reference (replay); None for plain
    seq: jax.Array  # [b, S] every committed token by position (prompt + generated)
    anchor_pos: jax.Array  # [b] s: position of the last committed token
    prompt_len: jax.Array  # [b]
    n_out: jax.Array  # [b] generated tokens so far
    done: jax.Array  # [b] bool
    finish: jax.Array  # [b] RUNNING / FINISH_*
    row_keys: jax.Array  # [b] typed PRNG keys (seed, prompt index)
    accept_hist: jax.Array  # [b, W] rounds per acceptance length 1..W
    max_new: jax.Array  # [b] max new tokens (data, not static: no recompile per value)
    stop_ids: jax.Array  # [K] EOS and stop ids, -1 padded
    stop_is_eos: jax.Array  # [K] bool: finish reason "eos" (else "stop")


MAX_STOP_IDS = 16


# --------------------------------------------------------------------------------------
# Pure cores
# --------------------------------------------------------------------------------------
def _prefill(static: DecodeStatic, target_params, drafter_params, drafter_state, prompt_bt,
             prompt_len, row_ids, seed, max_new, stop_ids, stop_is_eos) -> DecodeState:
    """Cache each prompt minus its last token in target and drafter; that token is the anchor."""
    b, p = prompt_bt.shape
    target = nnx.merge(static.target_graphdef, target_params)
    cfg = target.config
    cache = kvc.init_cache(cfg, b, static.cache_len)
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    cached_len = prompt_len - 1
    # the fresh cache holds nothing valid: attend to one (masked) slot, not all of them, which
    # XLA would otherwise constant-fold over the whole zero cache at compile time
    _, cache = target(prompt_bt, causal_meta(pos, pos < cached_len[:, None]), cache=cache,
                      cache_span=1)
    cache = cache.with_lengths(cached_len)
    if static.drafter_spec is not None:
        drafter_state = static.drafter_spec.prefill(drafter_params, drafter_state, prompt_bt, cached_len)
    seq = jnp.zeros((b, static.cache_len), jnp.int32).at[:, :p].set(
        jnp.where(pos < prompt_len[:, None], prompt_bt, 0))
    base = jax.random.key(seed)
    row_keys = jax.vmap(lambda r: jax.random.fold_in(base, r))(jnp.maximum(row_ids, 0).astype(jnp.uint32))
    padding = row_ids < 0
    return DecodeState(
        target_cache=cache, drafter_state=drafter_state, seq=seq, anchor_pos=cached_len,
        prompt_len=prompt_len, n_out=jnp.zeros((b,), jnp.int32), done=padding,
        finish=jnp.where(padding, FINISH_LENGTH, RUNNING).astype(jnp.int32), row_keys=row_keys,
        accept_hist=jnp.zeros((b, static.width), jnp.int32),
        max_new=jnp.broadcast_to(jnp.asarray(max_new, jnp.int32), (b,)),
        stop_ids=jnp.asarray(stop_ids, jnp.int32), stop_is_eos=jnp.asarray(stop_is_eos, bool))


def _draft(static: DecodeStatic, drafter_params, state: DecodeState):
    """One drafter forward: ``DraftOutput`` for positions s+1..s+W-1 and the new drafter state."""
    out, dstate = static.drafter_spec.propose(
        drafter_params, state.drafter_state, state.seq, state.anchor_pos, state.row_keys,
        static.sampling, static.width, static.sample_drafts)
    return out, dataclasses.replace(state, drafter_state=dstate)


def _no_draft(state: DecodeState, width: int) -> DraftOutput:
    return DraftOutput(jnp.zeros((state.seq.shape[0], width - 1), jnp.int32), None, None)


def _verify(static: DecodeStatic, target_params, state: DecodeState, draft: DraftOutput):
    """Target forward over ``[anchor, drafts]``; returns (accepted, next_token, cache, logits)."""
    target = nnx.merge(static.target_graphdef, target_params)
    s = state.anchor_pos
    anchor = jnp.take_along_axis(state.seq, s[:, None], axis=1)
    tokens = jnp.concatenate([anchor, draft.drafts], axis=1)
    pos = s[:, None] + jnp.arange(static.width, dtype=jnp.int32)[None]
    cache_in = state.target_cache

    def forward(span, cache, tokens, pos):
        return target(tokens, causal_meta(pos), cache=cache, cache_span=span,
                      defer_cache_write=True)

    logits, write = kvc.call_with_span(forward, jnp.max(cache_in.lengths), cache_in, tokens, pos)
    cache = write.apply(cache_in)
    accepted, next_token = static.acceptance_rule(logits, draft.drafts, draft.probs, s,
                                                  state.row_keys, static.sampling)
    return accepted, next_token, cache, logits


def _match(tokens: jax.Array, ids: jax.Array) -> jax.Array:
    """[..., K] equality against the (-1 padded) id list."""
    return (tokens[..., None] == ids) & (ids >= 0)


def _commit(static: DecodeStatic, state: DecodeState, drafts: jax.Array, accepted: jax.Array,
            next_token: jax.Array, target_cache: kvc.KVCache) -> DecodeState:
    """Append ``drafts[:a] + [next_token]`` per active row, cut at EOS/stop and max_new_tokens."""
    w = static.width
    b = state.seq.shape[0]
    idx = jnp.arange(w, dtype=jnp.int32)[None]
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jnp.where(idx < accepted[:, None], padded, next_token[:, None])
    count = accepted + 1
    is_stop = jnp.any(_match(emitted, state.stop_ids), axis=-1) & (idx < count[:, None])
    first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), w)
    room = state.max_new - state.n_out
    active = ~state.done
    n_emit = jnp.where(active, jnp.minimum(jnp.minimum(count, first_stop + 1), room), 0)
    write_pos = jnp.where(idx < n_emit[:, None], state.anchor_pos[:, None] + 1 + idx, state.seq.shape[1])
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, w))
    seq = state.seq.at[rows, write_pos].set(emitted, mode="drop")
    hit_stop = active & (first_stop < n_emit)
    stop_tok = jnp.take_along_axis(emitted, jnp.minimum(first_stop, w - 1)[:, None], axis=1)[:, 0]
    n_out = state.n_out + n_emit
    out_of_room = active & ~hit_stop & (n_out >= state.max_new)
    is_eos = jnp.any(_match(stop_tok, state.stop_ids) & state.stop_is_eos, axis=-1)
    finish = jnp.where(hit_stop, jnp.where(is_eos, FINISH_EOS, FINISH_STOP), state.finish)
    finish = jnp.where(out_of_room, FINISH_LENGTH, finish).astype(jnp.int32)
    anchor_pos = state.anchor_pos + n_emit
    hist = state.accept_hist + (jax.nn.one_hot(accepted, w, dtype=jnp.int32) * active[:, None])
    return dataclasses.replace(
        state, target_cache=target_cache.with_lengths(anchor_pos), seq=seq, anchor_pos=anchor_pos,
        n_out=n_out, done=state.done | hit_stop | out_of_room, finish=finish, accept_hist=hist)


def _round(static: DecodeStatic, target_params, drafter_params, state: DecodeState) -> DecodeState:
    if static.drafter_spec is None:
        draft = _no_draft(state, static.width)
    else:
        draft, state = _draft(static, drafter_params, state)
    accepted, next_token, cache, _ = _verify(static, target_params, state, draft)
    return _commit(static, state, draft.drafts, accepted, next_token, cache)


def _decode_fused(static: DecodeStatic, target_params, drafter_params, *prefill_args) -> DecodeState:
    state = _prefill(static, target_params, drafter_params, *prefill_args)
    # every round commits >= 1 token per active row, so max_new rounds always suffice
    def cond(carry):
        i, st = carry
        return (i < jnp.max(st.max_new)) & ~jnp.all(st.done)

    def body(carry):
        i, st = carry
        return i + 1, _round(static, target_params, drafter_params, st)

    _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state


prefill_step = jax.jit(_prefill, static_argnums=0)
draft_step = jax.jit(_draft, static_argnums=0, donate_argnums=2)
verify_step = jax.jit(_verify, static_argnums=0)
commit_step = jax.jit(_commit, static_argnums=0, donate_argnums=1)
round_step = jax.jit(_round, static_argnums=0, donate_argnums=3)
decode_fused = jax.jit(_decode_fused, static_argnums=0)


# --------------------------------------------------------------------------------------
# Python shell
# --------------------------------------------------------------------------------------
_MODES: dict[str, Callable] = {}
_LAZY_MODES = {"async": "d3d_jax.decoding.async_engine"}


def register_mode(name: str):
    """Decorator: ``fn(batch: PreparedBatch, **mode_options) -> (DecodeState, timings dict)``.

    ``timings`` may hold ``draft_s``/``verify_s``/``decode_s`` and extra metrics merged into each
    request's: ``metrics`` (dict, per batch) and ``row_metrics`` (list of dicts, per batch row).
    """

    def deco(fn):
        _MODES[name] = fn
        return fn

    return deco


@dataclasses.dataclass
class PreparedBatch:
    """One padded batch and everything a mode runner needs."""

    static: DecodeStatic
    target_params: Any
    drafter_params: Any
    drafter_state: Any
    prompt_bt: jax.Array
    prompt_len: jax.Array
    row_ids: np.ndarray  # prompt index per row, -1 for padding
    seed: int
    max_new_tokens: int = 128
    stop_ids: np.ndarray | None = None  # [MAX_STOP_IDS] eos then stop ids, -1 padded
    stop_is_eos: np.ndarray | None = None  # [MAX_STOP_IDS] bool
    # generate(row_seeds=...): per-row PRNG fold-in values replacing the prompt index in the
    # jitted core (-1 still marks padding); None: keys from the prompt index
    key_ids: np.ndarray | None = None

    def args(self):
        """Positional arguments of :func:`prefill_step` / :func:`decode_fused` after ``static``."""
        key_ids = self.row_ids if self.key_ids is None else self.key_ids
        stop_ids = (np.full((MAX_STOP_IDS,), -1, np.int32) if self.stop_ids is None
                    else self.stop_ids)
        stop_is_eos = (np.zeros((MAX_STOP_IDS,), bool) if self.stop_is_eos is None
                       else self.stop_is_eos)
        return (self.target_params, self.drafter_params, self.drafter_state, self.prompt_bt,
                self.prompt_len, jnp.asarray(key_ids, jnp.int32), jnp.int32(self.seed),
                jnp.int32(self.max_new_tokens), jnp.asarray(stop_ids, jnp.int32),
                jnp.asarray(stop_is_eos, bool))


_COMPILED: "collections.OrderedDict" = collections.OrderedDict()
_COMPILED_MAX = 32  # executables kept (least recently used dropped): long-lived servers see many shapes


def compiled_fused(static: DecodeStatic, args: tuple):
    """AOT-compiled :func:`decode_fused` for these shapes (so timings exclude compilation)."""
    leaves, treedef = jax.tree.flatten(args)
    # shardings too: an executable compiled for single-device params rejects mesh-sharded ones
    key = (static, treedef, tuple((np.shape(x), jnp.result_type(x), getattr(x, "sharding", None))
                                  for x in leaves))
    if key not in _COMPILED:
        _COMPILED[key] = decode_fused.lower(static, *args).compile()
        while len(_COMPILED) > _COMPILED_MAX:
            _COMPILED.popitem(last=False)
    _COMPILED.move_to_end(key)
    return _COMPILED[key]


def _run_fused(batch: PreparedBatch, **options):
    if options:
        raise ValueError(f"unknown mode options for fused decoding: {sorted(options)}")
    args = batch.args()
    t0 = time.perf_counter()
    fn = compiled_fused(batch.static, args)
    t1, c1 = time.perf_counter(), time.process_time()
    state = fn(*args)
    jax.block_until_ready(state.seq)
    # process CPU time too: on a shared CPU host it measures the work, not the contention
    return state, {"compile_s": t1 - t0, "decode_s": time.perf_counter() - t1,
                   "decode_cpu_s": time.process_time() - c1}


def _run_host_loop(batch: PreparedBatch, **options):
    """Round loop driven from Python with per-phase timing (slower: one sync per phase)."""
    if options:
        raise ValueError(f"unknown mode options for host-loop decoding: {sorted(options)}")
    static = batch.static
    state = prefill_step(static, *batch.args())
    # compile the timed steps on a throwaway copy first, so the phase times hold no compilation
    warm = jax.tree.map(jnp.copy, state)
    if static.drafter_spec is None:
        warm_draft = _no_draft(warm, static.width)
    else:
        warm_draft, warm = draft_step(static, batch.drafter_params, warm)
    jax.block_until_ready(verify_step(static, batch.target_params, warm, warm_draft))
    del warm, warm_draft
    draft_s = verify_s = 0.0
    loop_start = time.perf_counter()
    for _ in range(batch.max_new_tokens):
        if bool(jnp.all(state.done)):
            break
        t0 = time.perf_counter()
        if static.drafter_spec is None:
            draft = _no_draft(state, static.width)
        else:
            draft, state = draft_step(static, batch.drafter_params, state)
            jax.block_until_ready(draft.drafts)
        t1 = time.perf_counter()
        accepted, next_token, cache, _ = verify_step(static, batch.target_params, state, draft)
        jax.block_until_ready(next_token)
        t2 = time.perf_counter()
        draft_s += t1 - t0
        verify_s += t2 - t1
        state = commit_step(static, state, draft.drafts, accepted, next_token, cache)
    jax.block_until_ready(state.seq)
    # decode_s here: the rounds only (prefill and compilation excluded)
    return state, {"draft_s": draft_s if static.drafter_spec is not None else 0.0,
                   "verify_s": verify_s, "decode_s": time.perf_counter() - loop_start}


def _mode_runner(mode: str, loop: str) -> Callable:
    if mode in ("plain", "sync"):
        return {"device": _run_fused, "host": _run_host_loop}[loop]
    if mode not in _MODES and mode in _LAZY_MODES:
        import importlib

        importlib.import_module(_LAZY_MODES[mode])
    if mode not in _MODES:
        raise ValueError(f"mode must be one of plain|sync|{'|'.join(sorted(set(_MODES) | set(_LAZY_MODES)))}, got {mode!r}")
    return _MODES[mode]


def _as_drafter(drafter, target_vocab: int, mask_token_id: int | None):
    if drafter is None:
        return None
    if isinstance(drafter, (ModelDrafter, ReplayDrafter)) or hasattr(drafter, "spec"):
        d = drafter
    else:  # an NNX Qwen3
        d = ModelDrafter(drafter, mask_token_id)
    if d.vocab_size != target_vocab:
        raise ValueError(f"drafter vocab_size {d.vocab_size} differs from target vocab_size "
                         f"{target_vocab}: they must share one tokenizer")
    return d


def _validate_prompts(prompts, vocab: int) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of token-id lists")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: nothing to generate")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise ValueError(f"prompt {i} is a string; pass token ids (tokenize first)")
        ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab})")
        out.append(ids)
    return out


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def generate(target, prompts: Sequence[Sequence[int]], *, mode: str = "plain", drafter=None,
             sampling: SamplingParams = SamplingParams(), max_new_tokens: int = 128,
             eos_token_ids: Sequence[int] = (), stop_token_ids: Sequence[int] = (),
             batch_size: int | None = None, seed: int = 0, block_size: int = 16,
             mask_token_id: int | None = None, max_cache_len: int | None = None,
             row_seeds: Sequence[int] | None = None, prompt_pad_len: int | None = None,
             **mode_options) -> list[GenerationOutput]:
    """Generate for every prompt; outputs in prompt order.

    ``target``: an NNX :class:`~d3d_jax.model.qwen3.Qwen3`.  ``drafter`` (sync/async): a Qwen3
    drafter (its ``mask_token_id`` from the argument or its config), a :class:`ModelDrafter` or a
    :class:`ReplayDrafter`.  Mode options for plain/sync: ``loop="device"`` (fused on-device loop,
    default) or ``"host"`` (per-round Python loop that also times drafting and verifying);
    ``sample_drafts=True`` samples drafts from the drafter's q (sampling only) instead of its argmax;
    ``acceptance_rule=fn`` swaps the verification rule (experiments, statistical tests).
    ``row_seeds`` (plain/sync): one int in [0, 2**31) per prompt; prompt i then samples with
    ``fold_in(key(seed), row_seeds[i])`` instead of ``fold_in(key(seed), i)``, so its randomness
    does not depend on which other prompts share the call (data regeneration resumes with it).
    ``prompt_pad_len`` pads prompts to that length instead of the longest rounded up to 8, so a
    caller making many calls with bucketed lengths compiles once per bucket.
    Rows of a batch share shapes: prompts are right-padded to the longest prompt of the call and
    the cache length is fixed for the call, so one compile serves every batch.
    """
    cfg = target.config
    if not isinstance(sampling, SamplingParams):
        raise ValueError("sampling must be a SamplingParams")
    sampling.validate()
    if int(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompts = _validate_prompts(prompts, cfg.vocab_size)
    if mode not in ("plain", "sync"):
        _mode_runner(mode, "device")  # unknown modes fail here, before any work
    loop = mode_options.pop("loop", "device")
    if loop not in ("device", "host"):
        raise ValueError(f"loop must be 'device' or 'host', got {loop!r}")
    sample_drafts = bool(mode_options.pop("sample_drafts", False))
    rule = mode_options.pop("acceptance_rule", None)
    if mode == "plain":
        if drafter is not None:
            raise ValueError("mode='plain' takes no drafter")
        width, d = 1, None
    else:
        if drafter is None:
            raise ValueError(f"mode={mode!r} needs a drafter")
        if int(block_size) < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        width = int(block_size)
        d = _as_drafter(drafter, cfg.vocab_size, mask_token_id)
    for name, ids in (("eos_token_ids", eos_token_ids), ("stop_token_ids", stop_token_ids)):
        for t in ids:
            if not 0 <= int(t) < cfg.vocab_size:
                raise ValueError(f"{name} has id {t} outside the vocabulary [0, {cfg.vocab_size})")
    all_stops = [int(t) for t in eos_token_ids] + [int(t) for t in stop_token_ids]
    if len(all_stops) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} eos + stop token ids, got {len(all_stops)}")
    stop_ids = np.full((MAX_STOP_IDS,), -1, np.int32)
    stop_ids[: len(all_stops)] = all_stops
    stop_is_eos = np.arange(MAX_STOP_IDS) < len(eos_token_ids)
    n = len(prompts)
    if row_seeds is not None:
        if mode not in ("plain", "sync"):
            raise ValueError(f"row_seeds is supported by modes plain and sync, not {mode!r}")
        row_seeds = [int(s) for s in row_seeds]
        if len(row_seeds) != n or not all(0 <= s < 2 ** 31 for s in row_seeds):
            raise ValueError(f"row_seeds must hold one int in [0, 2**31) per prompt ({n} prompts)")
    bsz = n if batch_size is None else int(batch_size)
    if bsz < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    longest = max(len(p) for p in prompts)
    block = int(block_size)
    need = longest + int(max_new_tokens) + block
    if max_cache_len is None:
        cache_len = _round_up(need, 16)
    else:
        cache_len = int(max_cache_len)
        if block > cache_len:
            raise ValueError(f"block_size {block} is larger than max_cache_len {cache_len}")
        if longest > cache_len:
            raise ValueError(f"a prompt of {longest} tokens is longer than max_cache_len {cache_len}")
        if need > cache_len:
            raise ValueError(f"max_cache_len {cache_len} is too small: the longest prompt ({longest}) "
                             f"+ max_new_tokens ({max_new_tokens}) + block_size ({block}) = {need}")
    runner = _mode_runner(mode, loop)
    pad_len = _round_up(longest, 8)
    if prompt_pad_len is not None:
        if not longest <= int(prompt_pad_len) <= cache_len:
            raise ValueError(f"prompt_pad_len {prompt_pad_len} must be in [longest prompt {longest}, "
                             f"cache length {cache_len}]")
        pad_len = int(prompt_pad_len)
    graphdef, target_params = nnx.split(target)
    static = DecodeStatic(
        target_graphdef=graphdef, drafter_spec=d.spec if d is not None else None, sampling=sampling,
        width=width, cache_len=cache_len, sample_drafts=sample_drafts, rule=rule)

    outputs: list[GenerationOutput | None] = [None] * n
    for bi, start in enumerate(range(0, n, bsz)):
        rows = list(range(start, min(start + bsz, n)))
        row_ids = np.full((bsz,), -1, np.int32)
        row_ids[: len(rows)] = rows
        toks = np.zeros((bsz, pad_len), np.int32)
        lens = np.ones((bsz,), np.int32)
        for r, i in enumerate(rows):
            toks[r, : len(prompts[i])] = prompts[i]
            lens[r] = len(prompts[i])
        dstate = d.init_state(toks, lens, row_ids, cache_len) if d is not None else None
        key_ids = None
        if row_seeds is not None:
            key_ids = np.full((bsz,), -1, np.int32)
            key_ids[: len(rows)] = [row_seeds[i] for i in rows]
        batch = PreparedBatch(static, target_params, d.params if d is not None else None, dstate,
                              jnp.asarray(toks), jnp.asarray(lens), row_ids, int(seed),
                              max_new_tokens=int(max_new_tokens), stop_ids=stop_ids,
                              stop_is_eos=stop_is_eos, key_ids=key_ids)
        t0 = time.perf_counter()
        state, timings = runner(batch, **mode_options)
        wall = timings.get("decode_s", time.perf_counter() - t0)
        seq, n_out, finish, hist = jax.device_get((state.seq, state.n_out, state.finish,
                                                   state.accept_hist))
        for r, i in enumerate(rows):
            plen = len(prompts[i])
            ids = [int(t) for t in seq[r, plen: plen + n_out[r]]]
            met = M.request_metrics(hist[r], len(ids), wall, mode=mode, batch_index=bi,
                                    draft_s=timings.get("draft_s"), verify_s=timings.get("verify_s"),
                                    cpu_s=timings.get("decode_cpu_s"),
                                    compile_s=timings.get("compile_s"))
            # a mode runner's extra metrics: per batch ("metrics") and per row ("row_metrics")
            met.update(timings.get("metrics", {}))
            met.update(timings.get("row_metrics", [{}] * (r + 1))[r])
            outputs[i] = GenerationOutput(ids, FINISH_REASONS.get(int(finish[r]), "length"), met)
    return outputs  # type: ignore[return-value]


def summarize_outputs(outputs: Sequence[GenerationOutput]) -> dict:
    """Overall metrics of one :func:`generate` call (pooled τ and histogram, tokens/s, ...)."""
    return M.summarize([o.metrics for o in outputs])
