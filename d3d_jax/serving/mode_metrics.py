"""``/metrics`` lines for the decoder's round choices: rounds per mode and geometry,
tokens committed against tokens predicted by auto's choice, the rows of those rounds by auto's
reason for each, and round seconds against the seconds it predicted (its tokens per second is the one ratio over the other).  Self-contained: the metrics
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
             "tokens auto's choice expected of those rounds (0 for fixed modes)"),
            ("mode_timed_rounds_total", "timed_rounds",
             "one-part rounds timed (not after host work: admissions, row operations, a compile)"),
            ("mode_round_seconds_total", "seconds", "wall seconds of those timed rounds"),
            ("mode_predicted_round_seconds_total", "predicted_seconds",
             "seconds auto's choice expected of those timed rounds (0 for fixed modes)"),
            ("mode_gated_rounds_total", "gated_rounds",
             "rounds auto's gate ran all-plain without asking its choice (speculative rounds had "
             "delivered fewer tokens per wall second than plain ones at that load, or a plain probe)")):
        out += [f"# HELP d3d_{name} {help_}", f"# TYPE d3d_{name} counter"]
        out += [f"d3d_{name}{_labels(g)} {float(c.get(key, 0)):.6g}" for g, c in decisions.items()]
    reasons = [(g, k.partition(":")[2], v) for g, c in decisions.items() for k, v in sorted(c.items())
               if k.startswith("rows:")]
    if reasons:
        out += ["# HELP d3d_mode_row_rounds_total rows run in rounds of a geometry, by auto's reason "
                "(gain, batch, gate, acceptance, prompt, grammar: decoding/auto_reasons.py)",
                "# TYPE d3d_mode_row_rounds_total counter"]
        out += [f'd3d_mode_row_rounds_total{_labels(g)[:-1]},reason="{r}"}} {float(v):.6g}' for g, r, v in reasons]
    return out
