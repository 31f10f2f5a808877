"""``/metrics`` lines for the decoder's round choices (issue 25): rounds per mode and geometry,
and tokens committed against tokens predicted by auto's choice.  Self-contained: the metrics
exposition appends :func:`render`'s lines when the decoder reports decisions."""

from __future__ import annotations


def _labels(geometry: str) -> str:
    mode, _, shape = geometry.partition("/")
    return f'{{mode="{mode}",geometry="{shape or "-"}"}}'


def render(decisions: dict[str, dict]) -> list[str]:
    """Prometheus text lines of ``decoder.decisions()`` (geometry -> counters)."""
    if not decisions:
        return []
    out: list[str] = []
    for name, key, help_ in (
            ("mode_rounds_total", "rounds", "decoder rounds run, by mode and geometry"),
            ("mode_tokens_total", "tokens", "tokens committed by those rounds"),
            ("mode_predicted_tokens_total", "predicted_tokens",
             "tokens auto's choice expected of those rounds (0 for fixed modes)")):
        out += [f"# HELP d3d_{name} {help_}", f"# TYPE d3d_{name} counter"]
        out += [f"d3d_{name}{_labels(g)} {float(c.get(key, 0)):.6g}" for g, c in decisions.items()]
    return out
