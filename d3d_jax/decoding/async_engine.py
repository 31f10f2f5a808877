"""Asynchronous speculative decoding (spec §5): the target verifies while the drafter drafts ahead.

Each round the host dispatches two jitted computations before waiting on either:

* on the **target slice**: verify ``[anchor, d_1 … d_{B-1}]`` and commit the outcome
  (:func:`_verify_commit`, the engine's verification rule and commit);
* on the **drafter slice**: the branch pack (:mod:`~d3d_jax.decoding.branches`), one forward that
  drafts the next block for every likely outcome.

JAX dispatch is asynchronous, so both run at once (on disjoint device slices; one shared device is
still correct, just not overlapped).  The host then waits only for what decides the next round —
accepted count, correction token, new anchor — and matches it against the branches on the drafter
slice.  Hit: the matched branch is the next block at once and the drafter cache already holds the
accepted tokens (the shared prefix was written causally).  Miss: one synchronous draft.

Drafters: a :class:`~d3d_jax.decoding.drafting.ModelDrafter` (real branch pack) or a
:class:`~d3d_jax.decoding.drafting.ReplayDrafter` (reference continuation; :class:`AsyncReplayDrafter`
adds a ``hit_rate``: the alternatives at a position contain the reference token with that
probability, keyed by (seed, prompt, position), so a chosen fraction of rounds hit).
Drafts are always the drafter's argmax (point masses), as the branch alternatives assume.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from d3d_jax.config import ConfigError, MeshConfig
from d3d_jax.decoding import branches as br
from d3d_jax.decoding import engine as E
from d3d_jax.decoding import verify as V
from d3d_jax.decoding.drafting import ModelDrafter, ModelDraftSpec, ReplayDrafter, ReplayDraftSpec
from d3d_jax.model import kv_cache as kvc
from d3d_jax.model.masks import causal_meta
from d3d_jax.parallel.sharding import check_disjoint, make_mesh, split_devices, state_shardings

DEFAULT_BRANCH_POSITIONS = 12  # C (spec §5: the paper's optimum with F = 2)
DEFAULT_BRANCH_FANOUT = 2  # F
SALT_HIT = 5  # replay drafter's hit coin (verify.py uses salts 0..4)
_GREEDY = V.SamplingParams()
_DESCRIBED: set = set()


# --------------------------------------------------------------------------------------
# Replay drafter with a hit rate
# --------------------------------------------------------------------------------------
class AsyncReplayDrafter(ReplayDrafter):
    """A :class:`ReplayDrafter` whose branch alternatives hit at a chosen rate.

    ``error_rate`` sets τ (each draft token wrong with that probability).  ``hit_rate`` h sets
    how well the branch pack anticipates the target's token at a position: it is the drafter's
    first alternative with probability h, else the second with probability h, and so on (rank
    geometric), so fan-out F catches it with probability 1-(1-h)^F and the all-accept guess
    (one guess) with probability h.  h = 1: every outcome inside the C branch positions hits;
    h = 0: none does.  All coins are keyed by (seed, prompt, position).

    ``cost_model`` (a Qwen3 drafter): also run its real forwards (sync draft, branch pack) and
    discard their tokens, so benchmarks pay true drafting costs with a controlled τ and hit rate.
    """

    def __init__(self, continuations: Sequence[Sequence[int]], vocab_size: int,
                 error_rate: float = 0.0, hit_rate: float = 0.0, seed: int = 0, cost_model=None,
                 mask_token_id: int | None = None):
        super().__init__(continuations, vocab_size, error_rate, seed)
        if not 0.0 <= hit_rate <= 1.0:
            raise ValueError(f"AsyncReplayDrafter hit_rate must be in [0, 1], got {hit_rate}")
        # a traced parameter, not part of the static spec: one compile serves every hit rate
        self.params = {"hit_rate": jnp.float32(hit_rate)}
        self.cost_model = cost_model
        if cost_model is not None:
            md = ModelDrafter(cost_model, mask_token_id)
            if md.vocab_size != self.vocab_size:
                raise ValueError(f"cost_model vocab_size {md.vocab_size} != replay vocab_size "
                                 f"{self.vocab_size}")
            self.spec = CostedReplayDraftSpec(self.spec.vocab_size, self.spec.error_rate,
                                              self.spec.seed, md.spec)
            self.params["model"] = md.params
            self._model_drafter = md

    def init_state(self, prompt_tokens, prompt_lens, row_ids, cache_len):
        state = super().init_state(prompt_tokens, prompt_lens, row_ids, cache_len)
        if self.cost_model is not None:
            state["cache"] = self._model_drafter.init_state(prompt_tokens, prompt_lens, row_ids,
                                                            cache_len)
        return state


def _tie(tokens: jax.Array, logits: jax.Array) -> jax.Array:
    """``tokens``, made to depend on ``logits`` so the compiler cannot drop the forward."""
    return jnp.where(jnp.isnan(jnp.sum(logits)), 0, tokens).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class CostedReplayDraftSpec(ReplayDraftSpec):
    """Replay tokens, real drafter compute (see :class:`AsyncReplayDrafter` ``cost_model``)."""

    model_spec: ModelDraftSpec | None = None

    def prefill(self, params, state, prompt_bt, prefill_len):
        cache = self.model_spec.prefill(params["model"], state["cache"], prompt_bt, prefill_len)
        return dict(state, cache=cache)

    def propose(self, params, state, seq, anchor_pos, row_keys, sampling, block_size, sample_drafts):
        out_m, cache = self.model_spec.propose(params["model"], state["cache"], seq, anchor_pos,
                                               row_keys, _GREEDY, block_size, False)
        out, _ = ReplayDraftSpec.propose(self, params, state, seq, anchor_pos, row_keys, sampling,
                                         block_size, sample_drafts)
        return dataclasses.replace(out, drafts=_tie(out.drafts, out_m.logits)), dict(state, cache=cache)


def _replay_alternatives(spec: ReplayDraftSpec, params, state: dict, positions: jax.Array,
                         fanout: int) -> jax.Array:
    """``[b, K, F]`` alternatives for the tokens at ``positions [b, K]``: the reference token at
    a geometric rank (success probability ``hit_rate``) when that rank is < F; elsewhere tokens
    that differ from it."""
    ref_bs = state["ref"]
    vocab = spec.vocab_size
    tok = jnp.take_along_axis(ref_bs, jnp.clip(positions, 0, ref_bs.shape[1] - 1), axis=1)
    tok = jnp.where((positions < ref_bs.shape[1]) & (tok >= 0), tok, 0)
    base = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(spec.seed), i))(
        state["row"].astype(jnp.uint32))
    keys = V.position_keys(base, positions, SALT_HIT)
    h = params["hit_rate"] if params is not None else jnp.float32(0.0)  # plain replay: never
    u = V.uniform_keyed(keys)
    never = jnp.int32(fanout)
    ratio = jnp.log(u) / jnp.log1p(-jnp.clip(h, 1e-7, 1 - 1e-7))  # geometric rank by inversion
    rank = jnp.where(h >= 1.0, 0, jnp.where(h <= 0.0, never,
                                              jnp.floor(jnp.minimum(ratio, fanout)).astype(jnp.int32)))
    off = jax.vmap(lambda k: jax.random.randint(jax.random.fold_in(k, 1), (), 0, max(vocab - 1, 1)))(
        keys.reshape(-1)).reshape(positions.shape)
    j = jnp.arange(fanout, dtype=jnp.int32)
    wrong = (tok[..., None] + 1 + (off[..., None] + j) % max(vocab - 1, 1)) % vocab
    return jnp.where(j == rank[..., None], tok[..., None], wrong).astype(jnp.int32)


# --------------------------------------------------------------------------------------
# Static description and drafter-side cores
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AsyncStatic:
    """The static argument of every async core, hashed ONCE.

    ``jit`` hashes its static arguments on every call; a :class:`~d3d_jax.decoding.engine.DecodeStatic`
    holds NNX graphdefs whose hash walks the whole module graph (~0.15 ms per graphdef for the
    tiny config), paid by each of a round's 3-4 calls.  Caching the hash makes it a field read.
    The parameter treedefs live here too: the cores take flat leaf lists, because flattening an
    ``nnx.State`` on the host costs tens of microseconds per call (a list flattens in C++).
    """

    decode: E.DecodeStatic  # with the drafter spec (drafter-side cores)
    layout: br.BranchLayout
    mask_token_id: int
    target: E.DecodeStatic | None = None  # drafter-free copy (target-side cores)
    target_tree: Any = None  # treedef of the target params
    drafter_tree: Any = None  # treedef of the drafter params

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.decode, self.layout, self.mask_token_id,
                                                self.target, self.target_tree, self.drafter_tree)))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        # identity first: jit compares the cached key on every call, and a field-wise compare
        # walks both graphdefs (each generate() splits the models afresh); see intern_static
        if self is other:
            return True
        if not isinstance(other, AsyncStatic) or self._hash != other._hash:
            return False
        return all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(self))

    @property
    def spec(self):
        return self.decode.drafter_spec

    def drafter_params(self, leaves):
        return jax.tree.unflatten(self.drafter_tree, leaves)

    def target_params(self, leaves):
        return jax.tree.unflatten(self.target_tree, leaves)


def _verify_inputs(block: jax.Array, draft_len: jax.Array, mask_token_id: int):
    """Drafts fed to the target (padding as a real id) and compared by the rule (padding never
    matches): a shortened block's last slot can never be accepted."""
    drafts = block[:, 1:]
    real = jnp.arange(1, block.shape[1], dtype=jnp.int32)[None] <= draft_len[:, None]
    return jnp.where(real, drafts, mask_token_id), jnp.where(real, drafts, br.NO_TOKEN)


def _sync_block(ast: AsyncStatic, params, dstate, anchor_tok, anchor_pos, row_keys):
    """One synchronous draft from each row's anchor: ``(block, block_alts, draft_len, dstate)``."""
    b = anchor_tok.shape[0]
    bs = ast.layout.block_size
    seq_len = ast.decode.cache_len
    seq = jnp.zeros((b, seq_len), jnp.int32).at[jnp.arange(b), anchor_pos].set(anchor_tok)
    out, dstate = ast.spec.propose(params, dstate, seq, anchor_pos, row_keys, _GREEDY, bs, False)
    block = jnp.concatenate([anchor_tok[:, None], out.drafts], axis=1).astype(jnp.int32)
    if isinstance(ast.spec, ReplayDraftSpec):
        pos = anchor_pos[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
        alts = _replay_alternatives(ast.spec, params, dstate, pos, ast.layout.fanout)
    else:
        alts = br.slot_alternatives(out.logits, out.drafts, ast.layout.fanout)
        alts = jnp.concatenate([jnp.full_like(alts[:, :1], br.NO_TOKEN), alts], axis=1)
    return block, alts, jnp.full((b,), bs - 1, jnp.int32), dstate


def _branch_drafts(ast: AsyncStatic, params, dstate, block, block_alts, anchor_pos, draft_len):
    """Every branch's block (:class:`~d3d_jax.decoding.branches.BranchDrafts`) and drafter state."""
    lay = ast.layout
    if isinstance(ast.spec, ModelDraftSpec):
        model = nnx.merge(ast.spec.graphdef, params)
        return br.packed_forward(model, dstate, block, block_alts, anchor_pos, draft_len, lay,
                                 ast.mask_token_id)
    # replay: each branch is the reference from its own anchor (errors keyed by position, so a
    # branch equals the synchronous draft from that anchor); the all-accept guess follows the coin
    b, bs = block.shape
    corr = br.correction_alternatives(block_alts, draft_len, lay).reshape(b, lay.num_correction)
    r = jnp.repeat(jnp.arange(1, lay.positions, dtype=jnp.int32), lay.fanout)
    offsets = jnp.concatenate([jnp.broadcast_to(r, (b, lay.num_correction)), draft_len[:, None]], 1)
    starts = anchor_pos[:, None] + offsets  # [b, nbr]
    anchors = jnp.concatenate([corr, jnp.take_along_axis(block, draft_len[:, None], axis=1)], 1)
    drafts = jax.vmap(lambda ap: ReplayDraftSpec.propose(ast.spec, params, dstate, None, ap, None,
                                                         _GREEDY, bs, False)[0].drafts,
                      in_axes=1, out_axes=1)(starts)
    pos = starts[:, :, None] + jnp.arange(bs, dtype=jnp.int32)[None, None]
    alts = _replay_alternatives(ast.spec, params, dstate, pos.reshape(b, -1), lay.fanout)
    alts = alts.reshape(b, lay.num_branches, bs, lay.fanout)
    guess = alts[:, -1, 1, 0]
    drafts = drafts.at[:, -1, 0].set(guess)
    tokens = jnp.concatenate([anchors[:, :, None], drafts], axis=2).astype(jnp.int32)
    if isinstance(ast.spec, CostedReplayDraftSpec):  # pay for the real branch pack
        model = nnx.merge(ast.spec.model_spec.graphdef, params["model"])
        real, cache = br.packed_forward(model, dstate["cache"], block, block_alts, anchor_pos,
                                        draft_len, lay, ast.mask_token_id, with_logits=True)
        tokens = _tie(tokens, real.logits)
        dstate = dict(dstate, cache=cache)
    return br.BranchDrafts(tokens, alts, None), dstate


def _with_lengths(dstate, lengths):
    """Commit the drafter cache through ``lengths`` (a replay state may carry one as "cache")."""
    if isinstance(dstate, kvc.KVCache):
        return dstate.with_lengths(lengths)
    if isinstance(dstate, dict) and "cache" in dstate:
        return dict(dstate, cache=dstate["cache"].with_lengths(lengths))
    return dstate


_INTERNED: "collections.OrderedDict[AsyncStatic, AsyncStatic]" = collections.OrderedDict()
_INTERNED_MAX = 32


def intern_static(ast: AsyncStatic) -> AsyncStatic:
    """The one instance equal to ``ast``: jit's cache then matches it by identity each call
    (one deep compare per batch here instead of one per jitted call)."""
    ast = _INTERNED.setdefault(ast, ast)
    _INTERNED.move_to_end(ast)
    while len(_INTERNED) > _INTERNED_MAX:
        _INTERNED.popitem(last=False)
    return ast


# Decisions travel as one small int32 array [b, k] (columns below): one transfer, not four.
D_ACCEPTED, D_NEXT, D_ANCHOR, D_DONE = range(4)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def first_block_step(ast: AsyncStatic, d_leaves, dstate, anchor_tok, anchor_pos, row_keys):
    block, alts, dl, dstate = _sync_block(ast, ast.drafter_params(d_leaves), dstate, anchor_tok,
                                          anchor_pos, row_keys)
    return block, alts, dl, _verify_inputs(block, dl, ast.mask_token_id), dstate


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def packed_step(ast: AsyncStatic, d_leaves, dstate, block, block_alts, anchor_pos, draft_len):
    return _branch_drafts(ast, ast.drafter_params(d_leaves), dstate, block, block_alts, anchor_pos,
                          draft_len)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def select_step(ast: AsyncStatic, drafts: br.BranchDrafts, dstate, block_alts, draft_len, decision):
    """Match the verified outcome (``decision``, from :func:`verify_commit_step`); on a hit the
    branch is the next block.  The drafter cache commits through the new anchor (the shared
    prefix already wrote those K/V).  Dispatched right behind the packed forward, with no host
    wait between: ``host_view [b, 2]`` (done, hit) is the round's only device→host transfer."""
    accepted, next_token = decision[:, D_ACCEPTED], decision[:, D_NEXT]
    new_anchor, done = decision[:, D_ANCHOR], decision[:, D_DONE]
    guess = drafts.tokens[:, ast.layout.all_accept_index, 1]
    hit, branch = br.match_branch(block_alts, draft_len, guess, accepted, next_token, ast.layout)
    block, alts, dl = br.next_block_from_branch(drafts, branch, next_token, ast.layout,
                                                ast.mask_token_id)
    host_view = jnp.stack([done, hit.astype(jnp.int32)], axis=1)
    return (host_view, hit, block, alts, dl, _verify_inputs(block, dl, ast.mask_token_id),
            new_anchor, _with_lengths(dstate, new_anchor))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def miss_step(ast: AsyncStatic, d_leaves, dstate, hit, block, block_alts, draft_len, anchor_pos,
              row_keys):
    """Synchronous draft for the rows that missed (computed for all rows, kept where missed)."""
    s_block, s_alts, s_dl, dstate = _sync_block(ast, ast.drafter_params(d_leaves), dstate,
                                                block[:, 0], anchor_pos, row_keys)
    block = jnp.where(hit[:, None], block, s_block)
    block_alts = jnp.where(hit[:, None, None], block_alts, s_alts)
    draft_len = jnp.where(hit, draft_len, s_dl)
    return block, block_alts, draft_len, _verify_inputs(block, draft_len, ast.mask_token_id), dstate


# --------------------------------------------------------------------------------------
# Target-side core
# --------------------------------------------------------------------------------------
def _verify_commit(static: E.DecodeStatic, target_params, state: E.DecodeState, drafts_fed,
                   drafts_cmp):
    """Target forward over ``[anchor, drafts_fed]``, the engine's rule on ``drafts_cmp``, commit."""
    target = nnx.merge(static.target_graphdef, target_params)
    s = state.anchor_pos
    anchor = jnp.take_along_axis(state.seq, s[:, None], axis=1)
    pos = s[:, None] + jnp.arange(static.width, dtype=jnp.int32)[None]
    logits, cache = target(jnp.concatenate([anchor, drafts_fed], axis=1), causal_meta(pos),
                           cache=state.target_cache)
    accepted, next_token = static.acceptance_rule(logits, drafts_cmp, None, s, state.row_keys,
                                                  static.sampling)
    state = E._commit(static, state, drafts_cmp, accepted, next_token, cache)
    return state, accepted, next_token


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def verify_commit_step(ast: AsyncStatic, t_leaves, state: E.DecodeState, drafts_fed, drafts_cmp):
    """:func:`_verify_commit` plus the round's decision ``[b, 4]`` (accepted, target token, new
    anchor, done) for :func:`select_step` — it stays on device (no host round trip)."""
    state, accepted, next_token = _verify_commit(ast.target, ast.target_params(t_leaves), state,
                                                 drafts_fed, drafts_cmp)
    decision = jnp.stack([accepted, next_token, state.anchor_pos, state.done.astype(jnp.int32)],
                         axis=1).astype(jnp.int32)
    return state, decision


def _target_prefill(static, target_params, *prefill_args):
    """The engine's prefill, target side only (``prefill_args``: PreparedBatch.args()[3:])."""
    return E._prefill(static, target_params, None, None, *prefill_args)


target_prefill_step = jax.jit(_target_prefill, static_argnums=0)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def drafter_prefill_step(spec, params, dstate, prompt_bt, prefill_len):
    return spec.prefill(params, dstate, prompt_bt, prefill_len)


# --------------------------------------------------------------------------------------
# Device slices
# --------------------------------------------------------------------------------------
def resolve_slices(target_devices=None, drafter_devices=None, devices=None
                   ) -> tuple[list[jax.Device], list[jax.Device]]:
    """Target and drafter device lists from counts (as ``MeshConfig``) or explicit device lists.

    Neither given: both share the default device.  Lists must be disjoint or identical (shared).
    """
    devices = list(jax.devices() if devices is None else devices)
    if target_devices is None and drafter_devices is None:
        return devices[:1], devices[:1]
    if isinstance(target_devices, (int, np.integer)) or isinstance(drafter_devices, (int, np.integer)):
        if not (isinstance(target_devices, (int, np.integer))
                and isinstance(drafter_devices, (int, np.integer))):
            raise ConfigError("mesh.target_devices/drafter_devices: give both as counts or both as "
                              "device lists")
        cfg = MeshConfig(target_devices=int(target_devices), drafter_devices=int(drafter_devices))
        cfg.validate()
        return split_devices(cfg, devices)
    t, d = list(target_devices or []), list(drafter_devices or [])
    if not t or not d:
        raise ConfigError("mesh.target_devices/drafter_devices: give both device lists (non-empty)")
    known = {x.id for x in devices}
    for name, lst in (("target_devices", t), ("drafter_devices", d)):
        missing = [x for x in lst if getattr(x, "id", None) not in known]
        if missing:
            raise ConfigError(f"mesh.{name}: {missing[0]!r} is not one of the {len(devices)} devices")
    check_disjoint(t, d)
    return t, d


def _placer(devices: list[jax.Device]):
    """``(place_params, place)``: parameters by the logical rules on the slice, the rest replicated."""
    if len(devices) == 1:
        dev = devices[0]
        return (lambda tree: jax.device_put(tree, dev)), (lambda tree: jax.device_put(tree, dev))
    mesh: Mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=-1), devices)
    rep = NamedSharding(mesh, P())
    return ((lambda tree: jax.device_put(tree, state_shardings(tree, mesh))),
            (lambda tree: jax.device_put(tree, rep)))


# --------------------------------------------------------------------------------------
# The round loop (host shell)
# --------------------------------------------------------------------------------------
def _ready_at(x) -> float:
    jax.block_until_ready(x)
    return time.perf_counter()


@E.register_mode("async")
def run_async(batch: E.PreparedBatch, *, branch_positions: int = DEFAULT_BRANCH_POSITIONS,
              branch_fanout: int = DEFAULT_BRANCH_FANOUT, target_devices=None, drafter_devices=None,
              timeline: list | None = None, verbose: bool = True, **options):
    """Mode runner for ``engine.generate(mode="async")``; returns ``(DecodeState, timings)``.

    ``timeline`` (a list) receives one dict per round: dispatch and ready timestamps of the
    verify and of the packed forward, sync-draft time, hit flags.
    """
    if options:
        raise ValueError(f"unknown mode options for async decoding: {sorted(options)}")
    static = batch.static
    if static.sample_drafts:
        raise ValueError("mode='async' drafts the drafter's argmax (point masses): sample_drafts "
                         "is not supported")
    spec = static.drafter_spec
    if not isinstance(spec, (ModelDraftSpec, ReplayDraftSpec)):
        raise ValueError(f"mode='async' needs a ModelDrafter or ReplayDrafter, got {type(spec).__name__}")
    layout = br.BranchLayout(static.width, int(branch_positions), int(branch_fanout))
    layout.validate(prefix="async")
    mask = (spec.mask_token_id if isinstance(spec, ModelDraftSpec) else
            spec.model_spec.mask_token_id if isinstance(spec, CostedReplayDraftSpec) else 0)
    tstatic = dataclasses.replace(static, drafter_spec=None)  # target-side cores never see the drafter
    if verbose and layout not in _DESCRIBED:  # once per layout, not once per batch
        _DESCRIBED.add(layout)
        print(layout.describe(), flush=True)
    t_start = time.perf_counter()
    t_devs, d_devs = resolve_slices(target_devices, drafter_devices)
    shared = list(t_devs) == list(d_devs)  # one slice: nothing to move between the two sides
    t_params_put, t_put = _placer(t_devs)
    d_params_put, d_put = _placer(d_devs)
    to_target = (lambda x: x) if shared else t_put  # device-to-device, never through the host
    to_drafter = (lambda x: x) if shared else d_put

    tparams = t_params_put(batch.target_params)
    dparams = d_params_put(batch.drafter_params) if batch.drafter_params is not None else None
    t_leaves, t_tree = jax.tree.flatten(tparams)  # flattened once, not once per call
    d_leaves, d_tree = jax.tree.flatten(dparams)
    ast = intern_static(AsyncStatic(static, layout, int(mask), tstatic, t_tree, d_tree))
    prompt_len = np.asarray(batch.prompt_len)
    state = target_prefill_step(tstatic, tparams, *t_put(batch.args()[3:]))
    prompt_d, plen_d = d_put(batch.prompt_bt), d_put(jnp.asarray(prompt_len - 1, jnp.int32))
    dstate = drafter_prefill_step(spec, dparams, d_put(batch.drafter_state), prompt_d, plen_d)
    row_keys_d = d_put(state.row_keys)
    anchor_tok = np.asarray(batch.prompt_bt)[np.arange(len(prompt_len)), prompt_len - 1]
    block, alts, dl, (fed, cmp), dstate = first_block_step(ast, d_leaves, dstate,
                                                           d_put(jnp.asarray(anchor_tok, jnp.int32)),
                                                           plen_d, row_keys_d)
    anchor_d = plen_d
    done = np.asarray(jax.device_get(state.done))
    rows = len(prompt_len)
    hits = np.zeros(rows, np.int64)
    misses = np.zeros(rows, np.int64)
    totals = dict(verify_s=0.0, packed_s=0.0, sync_s=0.0, wait_s=0.0)
    rounds = sync_drafts = 0
    max_rounds = int(getattr(batch, "max_new_tokens", 0) or static.max_new_tokens)
    jax.block_until_ready((state.seq, fed))
    setup_s = time.perf_counter() - t_start  # placement, both prefills, the first (sync) block
    pool = cf.ThreadPoolExecutor(max_workers=2)
    host0 = time.thread_time()  # this thread's CPU time: the host cost of the rounds, no waits
    try:
        for _ in range(max_rounds):  # every round commits >= 1 token per active row
            if done.all():
                break
            fed_t, cmp_t = to_target((fed, cmp))
            # ---- dispatch verify, packed forward and selection; wait on none of them
            tv0 = time.perf_counter()
            state, decision = verify_commit_step(ast, t_leaves, state, fed_t, cmp_t)
            tv1 = time.perf_counter()
            drafts, dstate = packed_step(ast, d_leaves, dstate, block, alts, anchor_d, dl)
            td1 = time.perf_counter()
            v_ready = pool.submit(_ready_at, decision)
            d_ready = pool.submit(_ready_at, drafts.tokens)
            view, hit, block, alts, dl, (fed, cmp), anchor_d, dstate = select_step(
                ast, drafts, dstate, alts, dl, to_drafter(decision))
            # ---- the round's one device->host transfer: (done, hit) per row
            view_h = np.asarray(view)
            tw = time.perf_counter()
            done, hit_h = view_h[:, 0].astype(bool), view_h[:, 1].astype(bool)
            t_vr, t_dr = v_ready.result(), d_ready.result()
            need = ~done  # rows that go on need a next block
            missed_rows = need & ~hit_h
            hits += hit_h & need
            misses += missed_rows
            ts0 = time.perf_counter()
            missed = bool(missed_rows.any())
            if missed:
                block, alts, dl, (fed, cmp), dstate = miss_step(
                    ast, d_leaves, dstate, hit, block, alts, dl, anchor_d, row_keys_d)
                jax.block_until_ready(fed)  # so sync_s times the draft (verify needs it next anyway)
                sync_drafts += 1
            ts1 = time.perf_counter()
            rounds += 1
            sync_s = ts1 - ts0 if missed else 0.0
            totals["verify_s"] += t_vr - tv0
            totals["packed_s"] += t_dr - tv1
            totals["sync_s"] += sync_s
            totals["wait_s"] += tw - td1
            if timeline is not None:
                timeline.append(dict(
                    verify_dispatch=tv0, verify_ready=t_vr, packed_dispatch=tv1,
                    packed_dispatched=td1, packed_ready=t_dr, wait_s=tw - td1, sync_s=sync_s,
                    sync_draft=missed, hit=hit_h.tolist(), active=need.tolist(),
                    verify_devices=decision.devices(), packed_devices=drafts.tokens.devices()))
    finally:
        host_s = time.thread_time() - host0
        pool.shutdown(wait=True)
    totals["host_s"] = host_s
    per_round = {f"round_{k}": (v / rounds if rounds else 0.0) for k, v in totals.items()}
    judged = hits + misses
    timings = {
        "draft_s": totals["packed_s"] + totals["sync_s"],
        "verify_s": totals["verify_s"],
        "metrics": dict(per_round, async_rounds=rounds, sync_drafts=sync_drafts,
                        hit_rate_batch=float(hits.sum() / judged.sum()) if judged.sum() else float("nan"),
                        n_async=layout.budget, branch_positions=layout.positions,
                        branch_fanout=layout.fanout, wait_s=totals["wait_s"],
                        sync_s=totals["sync_s"], packed_s=totals["packed_s"],
                        sync_draft_s=totals["sync_s"] / sync_drafts if sync_drafts else 0.0,
                        setup_s=setup_s, loop_s=time.perf_counter() - t_start - setup_s),
        "row_metrics": [dict(hits=int(h), misses=int(m),
                             hit_rate=float(h / (h + m)) if h + m else float("nan"))
                        for h, m in zip(hits, misses)],
    }
    return state, timings
