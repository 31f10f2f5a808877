"""The pipeline report's reading of a dev-loss curve."""
import numpy as np

from d3d_jax.pipeline.report import flattening


def _curve(steps, losses):
    return [{"step": int(s), "dev_loss": float(v)} for s, v in zip(steps, losses)]


def test_flattening_reads_the_fall_of_a_line_through_the_last_fifth():
    steps = np.arange(40, 1201, 40)
    # falling 5 % over steps 960 -> 1200, straight: the fit reads exactly that
    loss = np.where(steps <= 960, 2.0 - steps / 960, 1.0 - 0.05 * (steps - 960) / 240)
    assert abs(flattening(_curve(steps, loss), 1200) - 0.05) < 1e-9
    # a curve that fell before 80 % and bent there: only the evals from 80 % on count
    bent = np.where(steps <= 960, 2.0 - steps / 960, 1.0)
    assert abs(flattening(_curve(steps, bent), 1200)) < 1e-9


def test_flattening_is_less_noisy_than_two_evals():
    """Flat curves with independent eval noise (1.5 %): the line through the last fifth's seven
    evals spreads about 0.8x as far as the eval at 80 % against the last one (sqrt(2) sigma)."""
    steps = np.arange(40, 1201, 40)
    rng = np.random.default_rng(0)
    fit, two = [], []
    for _ in range(500):
        loss = 1.0 + 0.015 * rng.standard_normal(len(steps))
        fit.append(flattening(_curve(steps, loss), 1200))
        at = int(np.argmin(np.abs(steps - 960)))
        two.append((loss[at] - loss[-1]) / loss[at])
    assert abs(np.mean(fit)) < 0.003  # unbiased
    assert np.std(fit) < 0.85 * np.std(two), (np.std(fit), np.std(two))


def test_flattening_with_few_evals_and_none():
    assert abs(flattening(_curve([100, 200], [2.0, 1.5]), 200) - 0.25) < 1e-12  # the two evals
    assert flattening(_curve([200], [1.0]), 200) is None
    assert flattening([{"step": 100, "dev_loss": None}, {"step": 200, "dev_loss": 1.0}], 200) is None
