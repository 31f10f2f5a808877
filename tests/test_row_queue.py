"""The row queue replays admissions and row operations in order and never leaves its caller a
device state that a dispatch has already consumed."""
import pytest

from d3d_jax.decoding import window as W
from d3d_jax.decoding.row_queue import RowQueue
from d3d_jax.decoding.strategies import OPS_PER_DISPATCH


class Boom(RuntimeError):
    pass


class CountingOps:
    """A strategy whose row-ops dispatch makes state n+1 from n (the real one donates n), and
    fails on its ``fail_on``-th call."""

    def __init__(self, fail_on=None):
        self.calls, self.fail_on, self.seen = 0, fail_on, []

    def row_ops(self, carry, ops, count):
        self.calls += 1
        if self.calls == self.fail_on:
            raise Boom("dispatch failed")
        self.seen.append([tuple(int(v) for v in op) for op in ops[:count]])
        return carry + 1


def test_ops_replay_in_order_in_fixed_size_dispatches():
    q, kept, strategy = RowQueue(config=None, pages=None), [], CountingOps()
    swaps = [(i, i + 1) for i in range(OPS_PER_DISPATCH + 3)]
    q.stop(5)
    q.swaps(swaps)
    q.replay(strategy, 0, None, None, {}, None, keep=kept.append)
    assert kept == [1, 2] and not q
    flat = [op for chunk in strategy.seen for op in chunk]
    assert flat == [(5, 0, W.OP_FREE)] + [(a, b, W.OP_SWAP) for a, b in swaps]


def test_a_failed_dispatch_leaves_the_last_state_made():
    q, kept = RowQueue(config=None, pages=None), []
    q.swaps([(i, i + 1) for i in range(2 * OPS_PER_DISPATCH + 1)])
    with pytest.raises(Boom):
        q.replay(CountingOps(fail_on=2), 0, None, None, {}, None, keep=kept.append)
    assert kept == [1]  # the first dispatch's state, not the consumed one it was given
