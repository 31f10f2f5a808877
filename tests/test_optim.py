"""8-bit AdamW: quantisation error bounds, tracking float32 AdamW, state size; the LR schedule."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from d3d_jax.config import OptimConfig
from d3d_jax.training import optim


def test_signed_quantization_round_trip_bound():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 300)) * jnp.logspace(-4, 0, 300)
    q = optim.quantize_signed(x, 128)
    assert q.codes.dtype == jnp.int8 and q.codes.shape == x.shape and q.scales.shape == (3, 5, 3)
    y = np.asarray(optim.dequantize_signed(q, 128))
    xb = np.pad(np.asarray(x), [(0, 0), (0, 0), (0, 84)]).reshape(3, 5, 3, 128)
    absmax = np.repeat(np.abs(xb).max(-1), 128, axis=-1)[..., :300]
    s = np.sqrt(np.abs(np.asarray(x)) / absmax)  # the companded value, quantised to steps of 1/127
    bound = absmax * (0.5 / 127) * (2 * s + 0.5 / 127) + 1e-12
    assert np.all(np.abs(y - np.asarray(x)) <= bound * 1.0001)
    assert np.all(np.sign(y) * np.sign(x) >= 0)  # never flips a sign


def test_unsigned_quantization_round_trip_bound():
    x = jax.random.uniform(jax.random.PRNGKey(1), (7, 256)) ** 4 * 1e-3
    q = optim.quantize_unsigned(x, 256)
    assert q.codes.dtype == jnp.uint8 and q.scales.shape == (7, 1)
    y = np.asarray(optim.dequantize_unsigned(q, 256))
    absmax = np.asarray(x).max(-1, keepdims=True)
    r = (np.asarray(x) / absmax) ** 0.25
    # error of r <= 0.5/255; d(r^4) <= 4 (r + 0.5/255)^3 · 0.5/255
    bound = absmax * 4 * (r + 0.5 / 255) ** 3 * (0.5 / 255) + 1e-15
    assert np.all(np.abs(y - np.asarray(x)) <= bound * 1.0001)
    assert np.all(y >= 0)


def test_adam8bit_tracks_adam_on_regression():
    # Linear regression: the 8-bit optimiser's trajectory stays near float32 Adam's.
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    X = jax.random.normal(k1, (256, 64))
    w_true = jax.random.normal(k2, (64, 8))
    Y = X @ w_true
    loss = lambda p: jnp.mean((X @ p["w"] - Y) ** 2)
    losses = {}
    for name, tx in (("fp32", optax.adamw(1e-2)), ("int8", optim.adamw_8bit(1e-2, block_size=64))):
        p = {"w": jnp.zeros((64, 8))}
        st = tx.init(p)
        step = jax.jit(lambda p, st: (lambda l, g: (l, *tx.update(g, st, p)))(*jax.value_and_grad(loss)(p)))
        for _ in range(300):
            l, upd, st = step(p, st)
            p = optax.apply_updates(p, upd)
        losses[name] = float(loss(p))
    assert losses["fp32"] < 0.2 * float(loss({"w": jnp.zeros((64, 8))}))
    assert abs(losses["int8"] - losses["fp32"]) <= 0.05 * losses["fp32"] + 1e-3, losses


def test_schedule_warmup_then_cosine():
    cfg = OptimConfig(learning_rate=1e-5, final_learning_rate=1e-6, warmup_steps=10)
    s = optim.lr_schedule(cfg, 110)
    assert float(s(0)) == 0.0 and math.isclose(float(s(10)), 1e-5, rel_tol=1e-6)
    assert math.isclose(float(s(5)), 5e-6, rel_tol=1e-5)
    for t in (30, 60, 100):  # cosine from 1e-5 to 1e-6 over steps 10..110
        want = 1e-6 + 0.5 * (1e-5 - 1e-6) * (1 + math.cos(math.pi * (t - 10) / 100))
        assert math.isclose(float(s(t)), want, rel_tol=1e-4)
    assert math.isclose(float(s(110)), 1e-6, rel_tol=1e-5)


def test_schedule_with_decay_steps_reaches_the_final_rate_there_and_holds_it():
    """decay_steps ends the cosine early: the same rates as a run of that length, then the final
    rate to the end (how a run is extended past its decay and resumed from its checkpoint)."""
    short = optim.lr_schedule(OptimConfig(learning_rate=1e-3, final_learning_rate=1e-4, warmup_steps=20), 800)
    long_ = optim.lr_schedule(OptimConfig(learning_rate=1e-3, final_learning_rate=1e-4, warmup_steps=20,
                                          decay_steps=800), 1200)
    for t in (0, 10, 20, 300, 650, 799, 800):
        assert float(long_(t)) == float(short(t)), t
    assert float(short(400)) > 2e-4  # mid-cosine, well above the floor
    for t in (801, 1000, 1200):
        assert math.isclose(float(long_(t)), 1e-4, rel_tol=1e-6), t
    plain = optim.lr_schedule(OptimConfig(learning_rate=1e-3, final_learning_rate=1e-4, warmup_steps=20), 1200)
    assert float(plain(1000)) > 1.2e-4  # without it the cosine would still be falling at 1000


@pytest.mark.parametrize("decay,steps,match", [
    (10, 100, r"optim.decay_steps: must be 0 .* or > the warm-up \(20 steps\), got 10"),
    (-1, 100, r"optim.decay_steps: must be >= 0"),
    (150, 100, r"optim.decay_steps: 150 is past train.steps=100"),
])
def test_decay_steps_out_of_range_are_refused_naming_the_key(decay, steps, match):
    from d3d_jax.config import ConfigError, TrainRunConfig, load_config

    with pytest.raises(ConfigError, match=match):
        load_config(TrainRunConfig, [], [f"optim.decay_steps={decay}", "optim.warmup_steps=20",
                                         f"train.steps={steps}"])
