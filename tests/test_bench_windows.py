"""``infer/bench.py windows`` times rounds of requests that are still running: a request that
finished inside a timed run makes its later rounds free, so the run is refused, not reported."""
import types

import pytest

from d3d_jax.bench import windows


class FakeDecoder:
    carry = None  # no device state to wait for

    def __init__(self, finish_at: int | None):
        self.calls, self.finish_at = 0, finish_at

    def step(self):
        self.calls += 1
        return {0: types.SimpleNamespace(finished=self.calls == self.finish_at)}


def test_a_request_finishing_inside_a_timed_run_is_refused():
    with pytest.raises(RuntimeError, match="1 request"):
        windows._seconds_per_round(FakeDecoder(finish_at=3), rounds=4)
    assert windows._seconds_per_round(FakeDecoder(finish_at=5), rounds=4) >= 0.0
    assert windows._seconds_per_round(FakeDecoder(finish_at=None), rounds=4) >= 0.0
