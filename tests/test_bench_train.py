"""``infer/bench.py train``: the FLOPs it divides by (mask pairs and matmul parameters against brute
force), a timed tiny run, and the large-model-on-CPU guard."""
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from d3d_jax.bench import train as bench
from d3d_jax.config import DataConfig, ModelConfig
from d3d_jax.model.masks import attention_mask
from d3d_jax.model.qwen3 import abstract_model
from d3d_jax.training import data as D

REPO = Path(__file__).resolve().parent.parent


def test_attended_pairs_equal_the_mask_and_flops_the_parameters():
    rng = np.random.default_rng(0)
    dc = DataConfig(packed_length=40 + 5 * 4, num_anchors=5, block_size=4)
    rows = []
    for n, rs in ((40, 3), (17, 10), (9, 2)):  # 5, 4 and 4 blocks; padding in the last two rows
        ex = D.Example(rng.integers(4, 50, n).astype(np.int32), rs)
        a, v = D.sample_anchors(rng, rs, n, dc.num_anchors, dc.block_size)
        rows.append(D.pack_example(ex, a, v, dc, 3))
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    meta = D.batch_meta(batch)
    assert bench.attended_pairs(batch) == int(np.sum(np.asarray(attention_mask(meta, meta))))

    for tied in (True, False):
        mc = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, tie_word_embeddings=tied)
        params = nnx.to_pure_dict(nnx.state(abstract_model(mc), nnx.Param))
        flat = {"/".join(map(str, p)): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
        # a layer's parameters are stacked: its matrices have a leading layer axis
        matrices = sum(int(np.prod(x.shape)) for k, x in flat.items()
                       if x.ndim - ("'layers'" in k) >= 2 and "embed" not in k)
        f = bench.step_flops(mc, batch)
        assert f["matmul_params"] == matrices + (64 * 32 if tied else 0)  # the tied head still multiplies
        assert f["linear"] == 6 * f["matmul_params"] * 3 * 60
        assert f["attention"] == 12 * 2 * 4 * 8 * f["attended_pairs"]


def test_tiny_run_reports_tokens_mfu_and_the_plan():
    r = bench.run_bench(str(REPO / "configs/train/tiny.yaml"), 1, 2, 2, ["model.num_layers=1"])
    t = r["throughput"]
    assert t["packed_tokens_per_s"] > 0 and 0 < t["mfu"] <= 1.0, t
    assert t["peak_memory_bytes"] is None  # CPU has no memory_stats
    assert r["plan"]["global_batch"] == 2 and t["plan_total_bytes"] > 0
    assert r["flops"]["tokens"] == 2 * 192


def test_large_model_on_cpu_prints_the_plan_instead_of_running():
    r = bench.run_bench(str(REPO / "configs/train/d3d-1.7b.yaml"), 1, 1, 1, [])
    assert "throughput" not in r and "not run on CPU" in r["skipped"] and "1.72B parameters" in r["skipped"]
    assert 1.6e9 < r["flops"]["matmul_params"] < 1.8e9 and r["plan"]["per_device_GiB"]["total"] > 20
