"""The async strategy (spec §5): each round is :class:`AsyncCore`'s three dispatches over a window
of the live rows — verify + commit on the target slice, then the branch pack and the hit/miss
selection on the drafter slice — and none of them waits on the host.

The branch pack is built for the window's rows only, so its cost follows the live requests, not
the slots.  The drafter side's next blocks reach the target slice as one small array (the
hand-off ``[slots, B+1]``), moved device to device after every drafter-side program.
"""

from __future__ import annotations

import jax

from d3d_jax.decoding import window as W
from d3d_jax.decoding.admission import admit as admit_rows
from d3d_jax.decoding.async_core import V_HIT, V_MISS, AsyncCore, handoff
from d3d_jax.decoding.async_loop import LiveRows, run_rounds
from d3d_jax.decoding.strategies import Carry, Context, Part, Strategy, result_out, windowed


def windowed_side(fn, rows: int, side, start, lo, hi, *args):
    """:func:`~d3d_jax.decoding.strategies.windowed` for the drafter side (no done flags: the
    decision says which rows are active)."""
    keep = W.window_mask(start, rows, lo, hi)
    v, out = fn(W.view(side, start, rows), *args)
    return W.merge(side, v, keep, start), out


class AsyncStrategy(Strategy):
    mode = "async"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        cfg = ctx.config
        self.acore = AsyncCore(self.home, ctx.drafter, cfg.layout)
        self.label = f"async/{cfg.branch_positions}x{cfg.branch_fanout}"
        self._init_side = self.jit(self.acore.init_state, name="init_side", static_argnums=0)
        self._admit_side = self.jit(self._admit_side_fn, donate_argnums=1)
        self._side_ops = self.jit(self._side_ops_fn, donate_argnums=0)
        self._target_step = self.jit(self._target_fn, static_argnames="rows", donate_argnums=1)
        self._packed = self.jit(self._packed_fn, static_argnames="rows", donate_argnums=1)
        self._select = self.jit(self._select_fn, static_argnames="rows", donate_argnums=1)

    def _to_target(self, x):
        return x if self.ctx.shared else self.ctx.t_put(x)  # device to device, never the host

    def _to_drafter(self, x):
        return x if self.ctx.shared else self.ctx.d_put(x)

    # ------------------------------------------------------------ state, admission, row ops
    def init(self, num_slots: int) -> Carry:
        side = self.ctx.d_put(self._init_side(num_slots))
        carry = super().init(num_slots)
        return Carry(carry.state, side, self._to_target(handoff(side.block, side.draft_len)))

    def _admit_side_fn(self, d_leaves, side, rows, index, count):
        cfg, dp = self.ctx.config, self.ctx.dp(d_leaves)
        side = admit_rows(side, rows, index, count,
                          prefill=lambda r: self.acore.prefill_drafter(dp, r),
                          insert=lambda s, new, slot: self.acore.insert(s, new, slot)[0],
                          cache_len=cfg.max_cache_len)
        return side, handoff(side.block, side.draft_len)

    def admit(self, carry: Carry, params, rows, index, count) -> Carry:
        carry = super().admit(carry, params, rows, index, count)
        side, hand = self._admit_side(params[1], carry.side, self.ctx.d_put(rows),
                                      self.ctx.d_put(index), count)
        return Carry(carry.state, side, self._to_target(hand))

    def _side_ops_fn(self, side, ops, count):
        side = W.apply_row_ops(side, ops, count)
        return side, handoff(side.block, side.draft_len)

    def row_ops(self, carry: Carry, ops, count) -> Carry:
        carry = super().row_ops(carry, ops, count)
        side, hand = self._side_ops(carry.side, self.ctx.d_put(ops), count)
        return Carry(carry.state, side, self._to_target(hand))

    # ------------------------------------------------------------ one round, three dispatches
    def _target_fn(self, t_leaves, state, hand, start, lo, hi, *, rows):
        tp = self.ctx.tp(t_leaves)
        h = jax.lax.dynamic_slice_in_dim(hand, start, rows)

        def step(v):
            v, decision, res = self.acore.target_step(tp, v, h)
            return v, (decision, res)

        state, (decision, res) = windowed(step, rows, state, start, lo, hi)
        return state, decision, res

    def _packed_fn(self, d_leaves, side, start, lo, hi, *, rows):
        dp = self.ctx.dp(d_leaves)
        side, drafts = windowed_side(lambda v: self.acore.packed(dp, v)[::-1],  # (side, drafts)
                                     rows, side, start, lo, hi)
        return drafts, side

    def _select_fn(self, d_leaves, side, drafts, decision, start, lo, hi, *, rows):
        dp = self.ctx.dp(d_leaves)

        def select(v):
            v, _, view = self.acore.select(dp, v, drafts, decision)
            return v, view

        side, view = windowed_side(select, rows, side, start, lo, hi)
        return side, handoff(side.block, side.draft_len), view

    def round(self, carry: Carry, params, start: int, lo: int, hi: int, rows: int):
        """Dispatch one round; returns ``(carry, decision, drafts, view, result)`` (device)."""
        t_leaves, d_leaves = params
        state, decision, res = self._target_step(t_leaves, carry.state, carry.hand, start, lo,
                                                 hi, rows=rows)
        drafts, side = self._packed(d_leaves, carry.side, start, lo, hi, rows=rows)
        side, hand, view = self._select(d_leaves, side, drafts, self._to_drafter(decision),
                                        start, lo, hi, rows=rows)
        return Carry(state, side, self._to_target(hand)), decision, drafts, view, res

    def dispatch(self, carry, params, groups, rows_info):
        lo, hi = groups[0][0], groups[-1][1]
        start, rows = self.ctx.window(lo, hi)
        self.note((self.label, rows))
        carry, _, _, view, res = self.round(carry, params, start, lo, hi, rows)
        out = dict(result_out(res), hit=view[:, V_HIT], miss=view[:, V_MISS])
        return carry, [Part(self.label, start, rows, lo, hi, out)]

    def _noop(self, carry: Carry, params, rows: int) -> Carry:
        self.note((self.label, rows))
        return self.round(carry, params, 0, 0, 0, rows)[0]

    def run_until_done(self, carry: Carry, params, lo: int, hi: int, *, live: LiveRows,
                       max_rounds: int, hook=None, **_) -> tuple[Carry, dict]:
        """Rounds that only dispatch (:func:`~d3d_jax.decoding.async_loop.run_rounds`)."""
        start, rows = self.ctx.window(lo, hi)
        self.note((self.label, rows))
        box = [carry]

        def dispatch():
            box[0], decision, drafts, view, _ = self.round(box[0], params, start, lo, hi, rows)
            return decision, drafts, view

        metrics = run_rounds(dispatch, live.shifted(start, rows), max_rounds, hook,
                             wait=lambda: jax.block_until_ready(box[0].hand))
        lay = self.ctx.config.layout
        metrics.update(n_async=lay.budget, branch_positions=lay.positions,
                       branch_fanout=lay.fanout, shared=self.ctx.shared)
        return box[0], metrics


__all__ = ["AsyncStrategy", "windowed_side"]
