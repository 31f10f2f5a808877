"""Auto mode: before every round, pick plain, sync with block ``b`` or async with ``(C, F)`` for
the current batch, by expected tokens per second (:mod:`~d3d_jax.decoding.auto_policy`).

Every geometry is a round program over the same state (one device slice):

* **plain**: :meth:`DecodeCore.round` with no drafter; the drafter's cache is left as it is.
* **sync/b**: the drafter first catches up on what plain rounds committed
  (:meth:`Drafter.catch_up`: causal forwards of the missing committed tokens, the K/V a prefill
  of them writes), then :meth:`DecodeCore.round` with a block of ``b``.
* **async/CxF**: catch up fully, redraft the rows whose next block is stale (it was drafted in
  another geometry's round, or not at all yet), then :class:`AsyncCore`'s verify, branch pack
  and selection, fused in one program (one device: nothing to overlap).

Every round verifies exactly, so outputs are plain decoding's whatever the mix (greedy: token for
token; sampling: the same keyed draws).  Each (geometry, window width) is one program; all are
compiled and timed at :meth:`AutoStrategy.warm_up` (start-up; the times kept in the program
store, so a restart reads them), or lazily when first run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from d3d_jax.decoding import window as W
from d3d_jax.decoding.async_core import V_HIT, V_MISS, AsyncCore, handoff
from d3d_jax.decoding.async_strategy import windowed_side
from d3d_jax.decoding.auto_gate import Gate
from d3d_jax.decoding.auto_reasons import count as count_reasons
from d3d_jax.decoding.auto_reasons import part_reasons
from d3d_jax.decoding.branches import BranchLayout
from d3d_jax.decoding.drafting import chunk_score, prefill_scored
from d3d_jax.decoding.auto_policy import (MIN_ROUNDS_TO_SET_ASIDE, REJUDGE_AFTER, Acceptance, Geometry,
                                          Policy, Pool, geometric_rate)
from d3d_jax.decoding.strategies import (OPS_PER_DISPATCH, Carry, Context, Part, Strategy, mark_done,
                                         result_out, windowed)
from d3d_jax.model import paged_kv as pkv

DEFAULT_PRIOR_TAU = 2.0  # a drafter of unknown quality: barely better than nothing
# a grammar-constrained request's prior: drafts of prose under a JSON schema were accepted at
# τ ≈ 1.1 (docs/results/serving.md, structured output), so such a request starts in plain rounds
GRAMMAR_PRIOR_TAU = 1.1
CALIBRATION_ROUNDS = 5  # timing passes over the programs at start-up, interleaved (after the compiles)
# rounds per program per pass, back to back after one untimed lead-in (why: docs/design/auto.md, start-up timing)
CALIBRATION_RUN = 2
# the start-up times, kept beside the programs they timed: a restart reads them, not re-times
COSTS_NOTE = "auto_round_costs"


def offline_tau(drafter_dir) -> float | None:
    """The drafter's offline τ on the dev split, from the ``result.json`` its training run left
    beside the weights (None if there is none): auto's prior."""
    path = Path(drafter_dir) / "result.json"
    try:
        tau = json.loads(path.read_text())["offline_tau_dev"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    tau = tau.get("tau") if isinstance(tau, dict) else tau
    return float(tau) if isinstance(tau, (int, float)) else None


class AutoStrategy(Strategy):
    mode = "auto"
    drafter_in_state = True
    loops = False

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        cfg = ctx.config
        self.target_core = ctx.core(cfg.block_size, False)
        self.cores = {"plain": ctx.core(1, False)}
        self.cores.update({f"sync/{b}": ctx.core(b, True) for b in cfg.auto_sync_blocks})
        self.async_cores = {f"async/{c}x{f}": AsyncCore(self.target_core, ctx.drafter,
                                                        BranchLayout(cfg.block_size, c, f))
                            for c, f in cfg.auto_async}
        geoms = [Geometry(label, core.width) for label, core in self.cores.items()]
        geoms += [Geometry(label, cfg.block_size) for label in self.async_cores]
        self.geometry = {g.label: g for g in geoms}
        self.policy = Policy(geoms, cfg.buckets)
        self.gate = Gate()
        tau = DEFAULT_PRIOR_TAU if cfg.prior_tau is None else float(cfg.prior_tau)
        # every request's prior: the drafter's acceptance pooled over finished requests, starting
        # from the offline τ (as trained: of a 16-token block)
        self.pool = Pool(cfg.block_size, geometric_rate(tau, max(16, cfg.block_size)))
        # constrained requests pool apart: their acceptance is the grammar's, not the drafter's
        self.grammar_pool = Pool(cfg.block_size, geometric_rate(GRAMMAR_PRIOR_TAU, max(16, cfg.block_size)))
        # plain and sync rounds take the state they read, not the carry: async's sides (and, for
        # plain, the drafter's state and parameters) stay out of their programs
        self._sync = self.jit(self._sync_fn, static_argnames=("label", "rows"), donate_argnums=2)
        self._plain = self.jit(self._plain_fn, static_argnames="rows", donate_argnums=1)
        self._async = self.jit(self._async_fn, static_argnames=("label", "rows"), donate_argnums=2)
        self._admit_all = self.jit(self._admit_all_fn, donate_argnums=2)
        self._piece_all = self.jit(self._piece_all_fn, donate_argnums=2)
        self._ops_all = self.jit(self._ops_all_fn, donate_argnums=0)

    # ------------------------------------------------------------ state, admission, row ops
    def init(self, num_slots: int) -> Carry:
        sides = {label: dataclasses.replace(self.jit(a.init_state, name=f"init_side_{label}",
                                                     static_argnums=0)(num_slots),
                                            dstate=None, anchor=jnp.full((num_slots,), -1, jnp.int32))
                 for label, a in self.async_cores.items()}
        return Carry(super().init(num_slots).state, sides,
                     prompt_score=jnp.full((num_slots,), jnp.nan, jnp.float32))

    def _admit_all_fn(self, t_leaves, d_leaves, carry: Carry, rows, index, count):
        """Prefill and insert as every strategy does, keeping each row's prompt score (from the
        drafter's prefill forward: :func:`~d3d_jax.decoding.drafting.prefill_scored`)."""
        tp, dp = self.ctx.tp(t_leaves), self.ctx.dp(d_leaves)

        def prefill(r):
            d, score = prefill_scored(self.ctx.drafter, dp, r.drafter_data, r.prompt, r.prompt_len - 1)
            return (self.home.prefill_target(tp, r), d), score

        def insert(t, parts, slot):
            (target, drafter), score = parts
            return self.home.insert(t[0], target, drafter, slot), t[1].at[slot].set(score, mode="drop")

        state, scores = self._admit_fn(t_leaves, d_leaves, (carry.state, carry.prompt_score), rows,
                                       index, count, prefill=prefill, insert=insert)
        # a new request has no next block in any async geometry yet: its first round redrafts
        stale = lambda side: dataclasses.replace(  # noqa: E731
            side, anchor=side.anchor.at[jnp.where(jnp.arange(index.shape[0]) < count, index,
                                                  side.anchor.shape[0])].set(-1, mode="drop"))
        return Carry(state, {k: stale(v) for k, v in carry.side.items()}, prompt_score=scores)

    def admit(self, carry: Carry, params, rows, index, count) -> Carry:
        return self._admit_all(*params, carry, rows, index, count)

    def _piece_all_fn(self, t_leaves, d_leaves, carry: Carry, rows, tokens, start, count, slot):
        """A prefill chunk as every strategy runs it; with its last, the row gets a prompt score
        (the drafter's over that chunk, from the same forward: :func:`chunk_score`; NaN for a
        drafter without a cache) and no next block in any async geometry yet."""
        state, logits = self._piece_logits(t_leaves, d_leaves, carry.state, rows, tokens, start,
                                           count, slot)
        score = (chunk_score(logits[1], rows.prompt, start, count) if len(logits) > 1
                 else jnp.full((1,), jnp.nan, jnp.float32))
        stale = lambda side: dataclasses.replace(side, anchor=side.anchor.at[slot].set(-1, mode="drop"))  # noqa: E731
        return dataclasses.replace(carry, state=state, side={k: stale(v) for k, v in carry.side.items()},
                                   prompt_score=carry.prompt_score.at[slot].set(score, mode="drop"))

    def prefill_piece(self, carry: Carry, params, rows, tokens, start, count, slot) -> Carry:
        put = self.ctx.t_put
        return self._piece_all(*params, carry, put(rows), put(tokens), put(start), put(count), put(slot))

    def _ops_all_fn(self, carry: Carry, ops, count):
        mark = lambda c, row, flag: dataclasses.replace(c, state=mark_done(c.state, row, flag))  # noqa: E731
        return W.apply_row_ops(carry, ops, count, mark)

    def row_ops(self, carry: Carry, ops, count) -> Carry:
        return self._ops_all(carry, ops, count)

    # ------------------------------------------------------------ round programs
    def _plain_fn(self, t_leaves, state, prompt_score, start, lo, hi, *, rows):
        """A plain round over ``state`` without the drafter's (a plain round never reads it)."""
        tp = self.ctx.tp(t_leaves)
        state, res = windowed(lambda v: self.cores["plain"].round(tp, None, v), rows, state, start, lo, hi)
        return state, self._out(res, prompt_score, start, rows)

    def _sync_fn(self, t_leaves, d_leaves, state, prompt_score, start, lo, hi, *, label, rows):
        tp, dp, core = self.ctx.tp(t_leaves), self.ctx.dp(d_leaves), self.cores[label]

        def round_(v):
            d = core.drafter.catch_up(dp, v.drafter_state, v.seq, v.anchor_pos, ~v.done, core.width)
            return core.round(tp, dp, dataclasses.replace(v, drafter_state=d))

        state, res = windowed(round_, rows, state, start, lo, hi)
        return state, self._out(res, prompt_score, start, rows)

    def _async_fn(self, t_leaves, d_leaves, carry: Carry, start, lo, hi, *, label, rows):
        tp, dp, acore = self.ctx.tp(t_leaves), self.ctx.dp(d_leaves), self.async_cores[label]
        side_full = carry.side[label]
        keep = W.window_mask(start, rows, lo, hi)

        def round_(v, side):
            # a paged drafter cache: the rows not in the round write nothing (a done row's
            # table may map another request's pages by now); the tables come back after
            dstate = v.drafter_state
            side = self._fresh_blocks(acore, dp, dataclasses.replace(
                v, drafter_state=pkv.only_rows(dstate, ~v.done)), side)
            v, decision, res = acore.target_step(tp, dataclasses.replace(v, drafter_state=None),
                                                 handoff(side.block, side.draft_len))
            drafts, side = acore.packed(dp, side)
            side, _, view = acore.select(dp, side, drafts, decision)
            table = getattr(dstate, "page_table", None)
            v = dataclasses.replace(v, drafter_state=side.dstate if table is None
                                    else side.dstate.with_page_table(table))
            return v, (dataclasses.replace(side, dstate=None), res, view)

        side_view = W.view(side_full, start, rows)
        state, (side, res, view) = windowed(round_, rows, carry.state, start, lo, hi, side_view)
        sides = dict(carry.side, **{label: W.merge(side_full, side, keep, start)})
        return (dataclasses.replace(carry, state=state, side=sides),
                dict(self._out(res, carry.prompt_score, start, rows), hit=view[:, V_HIT], miss=view[:, V_MISS]))

    @staticmethod
    def _out(res, prompt_score, start, rows: int) -> dict:
        """A round's per-row results, with each row's prompt score (read once by the host)."""
        return dict(result_out(res), prompt_score=W.view(prompt_score, start, rows))

    @staticmethod
    def _fresh_blocks(acore: AsyncCore, dp, v, side):
        """The side with the drafter state caught up and a synchronous block for stale rows."""
        d = acore.drafter.catch_up(dp, v.drafter_state, v.seq, v.anchor_pos, ~v.done, 0)
        stale = (side.anchor != v.anchor_pos) & ~v.done
        anchor_tok = jnp.take_along_axis(v.seq, v.anchor_pos[:, None], axis=1)[:, 0]

        def redraft(ops):
            block, alts, dl = acore.sync_block(dp, d, anchor_tok, v.anchor_pos, v.row_keys)
            return tuple(jnp.where(stale.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
                         for new, old in zip((block, alts, dl), ops))

        block, alts, dl = jax.lax.cond(jnp.any(stale), redraft, lambda ops: ops,
                                       (side.block, side.alts, side.draft_len))
        return dataclasses.replace(side, dstate=d, block=block, alts=alts, draft_len=dl,
                                   anchor=jnp.where(stale, v.anchor_pos, side.anchor),
                                   key_data=v.key_data)

    def _run(self, carry: Carry, params, label: str, start, lo, hi, rows):
        if label.startswith("async/"):
            return self._async(*params, carry, start, lo, hi, label=label, rows=rows)
        if label == "plain":
            dstate = carry.state.drafter_state
            state, out = self._plain(params[0], dataclasses.replace(carry.state, drafter_state=None),
                                     carry.prompt_score, start, lo, hi, rows=rows)
            state = dataclasses.replace(state, drafter_state=dstate)
        else:
            state, out = self._sync(*params, carry.state, carry.prompt_score, start, lo, hi, label=label, rows=rows)
        return dataclasses.replace(carry, state=state), out

    # ------------------------------------------------------------ the choice
    def _acceptance(self, info) -> Acceptance:
        if "acceptance" not in info.stats:
            info.stats["acceptance"] = self._new_acceptance(info.request)
        return info.stats["acceptance"]

    def _new_acceptance(self, request) -> Acceptance:
        """A constrained request is judged by the grammar pool from the start (its prompt score
        says nothing about drafts the grammar rejects); any other starts from the drafter's."""
        block = self.ctx.config.block_size
        if getattr(request, "grammar", None) is not None:
            return Acceptance(block, self.grammar_pool, prior_judges=True)
        return Acceptance(block, self.pool, scored=hasattr(self.ctx.drafter, "prefill_scored"))

    def initial_class(self, request) -> int:
        """Plain rounds (1) for a constrained request whose pooled acceptance says speculation
        does not pay (the grammar prior, until constrained requests that speculated say more),
        or before any round was priced; 0 for the rest."""
        if getattr(request, "grammar", None) is None:
            return 0
        return int(self._prefers_plain(self._new_acceptance(request), 1, True))

    def _prefers_plain(self, acc: Acceptance, n: int, constrained: bool) -> bool:
        """The policy's judgement; a constrained request also runs plain while no round was priced."""
        if constrained and not math.isfinite(self.policy.costs.get(self.policy.plain.label, self.policy.bucket(n))):
            return True
        return self.policy.prefers_plain(acc, n)

    def masked_label(self, cls: int, rows: int) -> str | None:
        """The geometry of a constrained round's part over placement class ``cls`` (``rows`` live
        rows): plain for the rows set aside, and for every row where the gate runs plain; else
        None (the widest sync geometry)."""
        if cls == 1 or not self.gate.speculates(self.policy.bucket(rows)):
            return "plain"
        return None

    def _pools(self, info) -> bool:
        """A finished request joins the pool once it passed its own judging (enough speculative
        rounds and never set aside): one that finished before it could be judged proves nothing.
        A server's warm-up request never joins (its prompt is n ones)."""
        acc = self._acceptance(info)
        return (info.stats.get("class", 0) == 0 and acc.rounds >= MIN_ROUNDS_TO_SET_ASIDE
                and not info.request.warmup)

    def _pool_of(self, info) -> Pool:
        return self.pool if getattr(info.request, "grammar", None) is None else self.grammar_pool

    def reclassify(self, infos: dict) -> dict:
        """slot -> class (0 speculate, 1 plain rounds) for requests whose class changes: set aside
        when speculation costs them more than it gives, back to speculate (and judged again on
        faded evidence) after ``REJUDGE_AFTER`` plain rounds, twice as many each time after."""
        n, out = len(infos), {}
        if n and not self.gate.speculates(self.policy.bucket(n)):
            return out  # every round runs plain here: moving rows between classes only costs
        for slot, info in infos.items():
            acc, stats = self._acceptance(info), info.stats
            constrained = getattr(info.request, "grammar", None) is not None
            if stats.get("class", 0) == 0:
                if self._prefers_plain(acc, n, constrained):
                    out[slot] = 1
                    stats["aside_at"] = info.modes["plain"]
                    stats["asides"] = stats.get("asides", 0) + 1
            elif info.modes["plain"] - stats.get("aside_at", 0) >= REJUDGE_AFTER << (stats.get("asides", 1) - 1):
                acc.fade()
                if self._prefers_plain(acc, n, constrained):  # judged still (prompt, grammar): no swap
                    stats["aside_at"] = info.modes["plain"]
                    stats["asides"] = stats.get("asides", 1) + 1
                else:
                    out[slot] = 0
        return out

    def dispatch(self, carry: Carry, params, groups, rows_info):
        rows = [(self._acceptance(i), i.request.max_new_tokens - i.n_out) for i in rows_info]
        boundary = groups[0][1] if groups[0][2] == 0 else 0
        gated = not self.gate.before(self.policy.bucket(len(rows)))
        # gated: speculation delivered less than plain rounds at this load (or a plain probe)
        plan = self.policy.all_plain(rows) if gated else self.policy.choose(rows, boundary)
        parts = []
        for lo, hi, geom in plan.groups:
            start, width = self.ctx.window(lo, hi)
            fresh = self.note((geom.label, width))
            carry, out = self._run(carry, params, geom.label, start, lo, hi, width)
            parts.append(Part(geom.label, start, width, lo, hi, out, fresh=fresh,
                              predicted=self.policy.tokens(rows[lo:hi], geom),
                              predicted_s=self.policy.seconds([(geom.label, self.policy.bucket(hi - lo))]),
                              gated=gated, row_reasons=self.row_reasons(rows_info, lo, hi, geom.label, gated,
                                                                         plan.explore)))
        return carry, parts

    def row_reasons(self, infos: list, lo: int, hi: int, label: str, gated: bool = False,
                    explore: bool = False) -> tuple:
        """Why each row ``lo … hi-1`` runs in ``label`` (:mod:`~d3d_jax.decoding.auto_reasons`)."""
        return part_reasons(infos, lo, hi, self.geometry[label].width > 1, gated, MIN_ROUNDS_TO_SET_ASIDE,
                            explore)

    def most_tokens(self, parts) -> int:
        return max(self.geometry[p.label].width for p in parts)

    def observe(self, parts, host_outs, seconds, snapshot, wall=None) -> None:
        for part, out in zip(parts, host_outs):
            count_reasons(part, snapshot)
            width = self.geometry[part.label].width
            for i, row in enumerate(range(part.start, part.start + part.rows)):
                slot, info = snapshot[row]
                if part.lo <= row < part.hi and info is not None and "prompt" not in info.stats:
                    info.stats["prompt"] = float(out["prompt_score"][i])
                    self._acceptance(info).set_prompt(info.stats["prompt"])
                if part.lo <= row < part.hi and info is not None and int(out["count"][i]) > 0:
                    acc = self._acceptance(info)
                    acc.record(width, int(out["accepted"][i]))
                    if int(out["finish"][i]) and self._pools(info):
                        self._pool_of(info).add(acc)  # the next requests' prior
        fresh = any(p.fresh for p in parts)
        if seconds is not None and not fresh:  # a split: its own key
            self.policy.measured([(p.label, p.rows) for p in parts], seconds)
        self.gate.observe(self.policy.bucket(sum(p.hi - p.lo for p in parts)),
                          any(self.geometry[p.label].width > 1 for p in parts),
                          sum(int(np.sum(o["count"])) for o in host_outs), None if fresh else wall)

    # ------------------------------------------------------------ start-up
    def warm_up(self, carry: Carry, params, widths: tuple[int, ...], prompt_cap: int | None = None) -> Carry:
        """Compile every (geometry, width) program and time it: the costs' starting point (an
        untimed width is scaled from the nearest timed one, or timed when first run).  The times
        are kept in the program store; a start that finds them for every program (same decoder,
        model, devices and code) reads them instead of timing again.  The timed
        rounds are interleaved (``CALIBRATION_RUN`` of each program per pass after an untimed
        lead-in, ``CALIBRATION_ROUNDS`` passes, the median kept), so a change of load on the
        machine moves every geometry's time alike and leaves their ratios, which are what the
        choice weighs, as they are."""
        carry = super().warm_up(carry, params, widths, prompt_cap)  # compiles (several at once), runs each once
        keys = [(label, width) for width in widths for label in self.geometry]
        saved = self._saved_costs()
        if all(key in saved for key in keys):  # timed by an earlier start with these programs
            for (label, width), seconds in saved.items():
                self.policy.costs.calibrate(label, width, seconds)
            return carry
        carry, times = self._time_rounds(carry, params, keys)
        for (label, width), seconds in times.items():
            self.policy.costs.calibrate(label, width, seconds)
        self.ctx.programs.write_note(COSTS_NOTE, {"rounds": [
            {"geometry": label, "rows": width, "seconds": seconds}
            for (label, width), seconds in sorted({**saved, **times}.items())]})
        return carry

    def warm_rounds(self, carry: Carry, params, widths: tuple[int, ...], prompt_cap: int | None = None) -> Carry:
        carry = self.warm_admission(carry, params, prompt_cap)
        for width in widths:
            for label in self.geometry:
                self.note((label, width))
                carry, _ = self._run(carry, params, label, 0, 0, 0, width)
        return self.row_ops(carry, np.zeros((OPS_PER_DISPATCH, 3), np.int32), 0)

    def _saved_costs(self) -> dict[tuple[str, int], float]:
        """Start-up round times an earlier start kept in the program store (same decoder, model,
        devices and code: the store's salt), for the geometries this decoder has."""
        note = self.ctx.programs.read_note(COSTS_NOTE) or {}
        out = {}
        for r in note.get("rounds", []) if isinstance(note.get("rounds"), list) else []:
            try:
                key, seconds = (str(r["geometry"]), int(r["rows"])), float(r["seconds"])
            except (KeyError, TypeError, ValueError):
                return {}  # not a note this code wrote: time again
            if key[0] in self.geometry and 0 < seconds < math.inf:
                out[key] = seconds
        return out

    def _time_rounds(self, carry: Carry, params, keys: list) -> tuple[Carry, dict]:
        """The median time of each (geometry, width)'s no-op round, interleaved (the docstring
        of :meth:`warm_up`)."""
        times: dict = {key: [] for key in keys}
        for _ in range(CALIBRATION_ROUNDS):
            for label, width in keys:
                carry, _ = self._run(carry, params, label, 0, 0, 0, width)  # the lead-in
                jax.block_until_ready(carry)
                t0 = time.perf_counter()
                for _ in range(CALIBRATION_RUN):  # back to back, as served rounds run
                    carry, _ = self._run(carry, params, label, 0, 0, 0, width)
                jax.block_until_ready(carry)
                times[(label, width)].append((time.perf_counter() - t0) / CALIBRATION_RUN)
        return carry, {key: float(np.median(ts)) for key, ts in times.items()}
