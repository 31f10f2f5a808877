"""``infer/bench.py shapes``: plain decoding's ms/token over a grid of small model shapes, against
what each shape's arithmetic predicts from the fastest cell.

A cell is a 4-layer, 256-wide Qwen3 (random weights, vocab 4096, head dim 64, one module per
layer as decoders run it) with its query / KV heads and MLP width, decoding ``new`` tokens
greedily after a 32-token prompt at batch 1 (``engine.generate``, the engine benchmark's setup).
Its work per token is what the arithmetic of a batch-1 step needs: every weight once (one
multiply-add per weight) plus the attention over the cache span the step reads (query heads ×
head dim × span, for the scores and again for the values), the span being the engine's bucket
for each position, averaged over the run. The prediction for a cell is the fastest cell's ms per
unit of work times its own work; a cell slower than 1.5× its prediction is a shape cliff.

Each checkout runs in fresh processes importing ``d3d_jax`` from that checkout (``--compare-with
DIR`` adds another, say a ``git worktree`` of main), run A B B A, each round timing every cell
once (wall clock and process CPU time); a cell's figure is its fastest round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from d3d_jax.errors import UsageError
from d3d_jax.model.kv_cache import span_buckets

DEFAULT_CELLS = ",".join(f"{h}:{f}:{n}" for h in ("4/4", "4/2", "4/1", "8/8") for f in (512, 1536)
                         for n in (128, 512))
SHAPE = dict(layers=4, hidden=256, head_dim=64, vocab=4096, prompt_len=32, block_size=16)
GOAL = 1.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cells", default=DEFAULT_CELLS,
                   help="comma-separated HEADS/KV_HEADS:INTERMEDIATE:NEW_TOKENS cells")
    p.add_argument("--rounds", type=int, default=2, help="rounds per process (each times every cell once)")
    p.add_argument("--compare-with", default=None, metavar="CHECKOUT",
                   help="also measure another checkout of this project, interleaved A B B A")
    p.add_argument("--json-out", default=None, help="also write the JSON result here")


def parse_cells(text: str) -> list[tuple[int, int, int, int]]:
    """``(heads, kv_heads, intermediate, new_tokens)`` per cell; one clear error for a bad one."""
    cells = []
    for item in filter(None, (c.strip() for c in text.split(","))):
        try:
            heads, f, n = item.split(":")
            q, k = (int(x) for x in heads.split("/"))
            cell = (q, k, int(f), int(n))
        except ValueError:
            raise UsageError(f"--cells: {item!r} is not HEADS/KV_HEADS:INTERMEDIATE:NEW_TOKENS") from None
        if min(cell) < 1 or q % k:
            raise UsageError(f"--cells: {item!r} needs positive sizes and heads a multiple of KV heads")
        cells.append(cell)
    if not cells:
        raise UsageError("--cells: no cell given")
    return cells


def work_per_token(heads: int, kv_heads: int, intermediate: int, new: int) -> float:
    """Multiply-adds per generated token: weights once, plus attention over each step's span."""
    d, h, layers, vocab = SHAPE["hidden"], SHAPE["head_dim"], SHAPE["layers"], SHAPE["vocab"]
    weights = layers * (d * (heads + 2 * kv_heads) * h + heads * h * d + 3 * d * intermediate) + vocab * d
    need = SHAPE["prompt_len"] + new + SHAPE["block_size"]
    cache_len = -(-need // 16) * 16
    spans = span_buckets(cache_len)
    # the step that makes token j reads the smallest span holding the committed prompt_len + j slots
    mean_span = sum(next(s for s in spans if s >= SHAPE["prompt_len"] + j) for j in range(new)) / new
    return weights + layers * 2 * heads * h * mean_span


def measure(cells, rounds: int) -> dict:
    """``cell -> (best wall s, best CPU s)`` per token, in this process (the checkout on PYTHONPATH)."""
    import numpy as np

    from d3d_jax.bench.generator import Generator
    from d3d_jax.config import ModelConfig
    from d3d_jax.model.qwen3 import init_model, unstacked

    prompt = np.random.default_rng(0).integers(0, SHAPE["vocab"], SHAPE["prompt_len"]).tolist()
    gen, runs = Generator(), {}
    for q, k, f, n in cells:
        cfg = ModelConfig(vocab_size=SHAPE["vocab"], hidden_size=SHAPE["hidden"], intermediate_size=f,
                          num_layers=SHAPE["layers"], num_heads=q, num_kv_heads=k, head_dim=SHAPE["head_dim"],
                          max_position_embeddings=4096)
        model = unstacked(init_model(cfg))  # as the commands load a target (no weight slicing)
        runs[(q, k, f, n)] = lambda m=model, n=n: gen(m, [prompt], max_new_tokens=n,
                                                      block_size=SHAPE["block_size"])[0].metrics
        runs[(q, k, f, n)]()  # compiles
    best = {c: [float("inf")] * 2 for c in runs}
    for _ in range(rounds):
        for c, run in runs.items():
            m = run()
            best[c] = [min(best[c][0], m["batch_wall_s"] / c[3]), min(best[c][1], m["batch_cpu_s"] / c[3])]
    return best


def _child(args, root: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root))
    env.setdefault("JAX_PLATFORMS", "cpu")
    given = json.dumps(dict(cells=args.cells, rounds=args.rounds))
    res = subprocess.run([sys.executable, __file__, given], env=env, capture_output=True, text=True, cwd=root)
    found = [ln for ln in res.stdout.splitlines() if ln.startswith("CELLS ")]
    if res.returncode or not found:
        raise RuntimeError(f"the measuring process ({root}) failed ({res.returncode}): {res.stderr[-2000:]}")
    return {tuple(r["cell"]): (r["wall_s"], r["cpu_s"]) for r in json.loads(found[-1][6:])}


def summarize(best: dict) -> list[dict]:
    """Per cell: ms/token (wall, CPU), work, and measured ÷ predicted from the fastest cell (wall)."""
    rate = min(w / work_per_token(*c) for c, (w, _) in best.items())  # seconds per multiply-add
    rows = []
    for c, (wall, cpu) in best.items():
        work = work_per_token(*c)
        rows.append(dict(heads=f"{c[0]}/{c[1]}", intermediate=c[2], new_tokens=c[3], work_M=work / 1e6,
                         wall_ms=1e3 * wall, cpu_ms=1e3 * cpu, predicted_ms=1e3 * rate * work,
                         over_prediction=wall / (rate * work)))
    return rows


def table(rows: list[dict], other: list[dict] | None = None) -> str:
    head = "| heads | intermediate | new tokens | M multiply-adds / token | ms/token wall (CPU) | ÷ predicted |"
    lines = [head + (" compare: ms/token wall (CPU) | ÷ predicted |" if other else ""),
             "|" + "---|" * (8 if other else 6)]
    for i, r in enumerate(rows):
        line = (f"| {r['heads']} | {r['intermediate']} | {r['new_tokens']} | {r['work_M']:.2f} | "
                f"{r['wall_ms']:.3f} ({r['cpu_ms']:.3f}) | {r['over_prediction']:.2f} |")
        if other:
            o = other[i]
            line += f" {o['wall_ms']:.3f} ({o['cpu_ms']:.3f}) | {o['over_prediction']:.2f} |"
        lines.append(line)
    return "\n".join(lines)


def main(args) -> dict:
    parse_cells(args.cells)  # a bad cell fails here, before any work
    here = Path(__file__).resolve().parents[2]
    roots = {"this checkout": here}
    if args.compare_with:
        roots["compare"] = Path(args.compare_with).resolve()
    order = list(roots) + list(reversed(roots))  # A B B A: both see the same drift of the load
    best: dict = {label: {} for label in roots}
    loads = [os.getloadavg()]
    for label in order:
        for c, (w, cpu) in _child(args, roots[label]).items():
            old = best[label].get(c, (float("inf"), float("inf")))
            best[label][c] = (min(old[0], w), min(old[1], cpu))
        loads.append(os.getloadavg())
    rows = {label: summarize(b) for label, b in best.items()}
    print(table(rows["this checkout"], rows.get("compare")))
    worst = max(r["over_prediction"] for r in rows["this checkout"])
    print(f"\nworst cell {worst:.2f}x its prediction (goal <= {GOAL}); load averages (1 min) "
          + ", ".join(f"{x[0]:.1f}" for x in loads))
    result = dict(rows=rows, roots={k: str(v) for k, v in roots.items()}, load_averages=loads, goal=GOAL,
                  args={k: v for k, v in vars(args).items() if k != "func"})
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":  # the measuring process of _child
    given = json.loads(sys.argv[1])
    best = measure(parse_cells(given["cells"]), given["rounds"])
    print("CELLS " + json.dumps([dict(cell=c, wall_s=w, cpu_s=cpu) for c, (w, cpu) in best.items()]))
