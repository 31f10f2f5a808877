"""Regeneration (spec §2.1): prompt formats, sharding, bucketing, resume, and runs through the engine."""

import json
import random

import pytest
from d3d_jax.bench.generator import Generator

from d3d_jax.training import regenerate as rg


# ----------------------------------------------------------------------------------------------
# Reading prompts
# ----------------------------------------------------------------------------------------------
def _write_lines(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else line.encode("utf-8")) + b"\n")
    return path


def test_read_prompts_formats_and_user_side(tmp_path):
    lines = [
        json.dumps({"id": "m1", "messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "later"}]}),
        json.dumps({"id": 7, "conversations": [
            {"from": "human", "value": "first"}, {"from": "human", "value": "second"},
            {"from": "gpt", "value": "old"}, {"from": "human", "value": "third"}]}),
        json.dumps({"id": "p1", "prompt": "plain", "system": "sys"}),
        json.dumps({"id": "p2", "prompt": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]}]}),
        "",  # blank lines are not prompts
        json.dumps({"conversations": [{"from": "system", "value": "S"}, {"from": "user", "value": "Q"}]}),
    ]
    prompts, malformed = rg.read_prompts(_write_lines(tmp_path / "p.jsonl", lines))
    assert malformed == []
    got = {p.id: p.messages for p in prompts}
    assert got["m1"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert got["7"] == [{"role": "user", "content": "first"}, {"role": "user", "content": "second"}]
    assert got["p1"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "plain"}]
    assert got["p2"] == [{"role": "user", "content": "ab"}]
    derived = [p for p in prompts if p.line == 6][0]
    assert derived.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert derived.id.startswith("h") and len(derived.id) == 17
    assert [p.line for p in prompts] == [1, 2, 3, 4, 6]


def test_malformed_lines_are_listed_and_nothing_else_dropped(tmp_path):
    good = {"prompt": "same text"}
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"text": "no known field"}),
        json.dumps({"messages": [{"role": "assistant", "content": "answer first"}]}),
        json.dumps({"messages": [{"role": "tool", "content": "x"}, {"role": "user", "content": "q"}]}),
        json.dumps({"id": "dup", "prompt": "x"}),
        json.dumps({"id": "dup", "prompt": "y"}),
        json.dumps({"id": True, "prompt": "z"}),
        b"\xff\xfe not utf-8",
        json.dumps({"messages": [{"role": "user", "content": "   "}]}),
        json.dumps(good),  # the same prompt again is a second prompt, not a duplicate
    ]
    prompts, malformed = rg.read_prompts(_write_lines(tmp_path / "p.jsonl", lines))
    assert [n for n, _ in malformed] == [2, 3, 4, 5, 6, 8, 9, 10, 11]
    reasons = dict(malformed)
    assert "duplicate id 'dup' (first on line 7)" in reasons[8]
    assert "'tool'" in reasons[6]
    assert "JSON" in reasons[2] and "JSON" in reasons[10]
    assert [p.line for p in prompts] == [1, 7, 12]
    assert prompts[2].id == prompts[0].id + "-1"  # repeated content keeps both, with distinct ids
    assert len(prompts) + len(malformed) == len([x for x in lines if x])


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from d3d_jax.demo.tokenizer import train_tokenizer

    texts = ["To be, or not to be, that is the question. Whether tis nobler in the mind to suffer "
             "the slings and arrows of outrageous fortune.", "def add(a, b):\n    return a + b\n"] * 4
    out = train_tokenizer(texts, vocab_size=300, out_dir=tmp_path_factory.mktemp("tok"), min_frequency=1)
    return AutoTokenizer.from_pretrained(out)


def test_render_prompt_uses_template_without_thinking(tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be?"}]
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTo be?<|im_end|>\n"
                "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = rg.render_prompt(tokenizer, msgs)
    assert tokenizer.decode(ids) == expected
    assert ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


# ----------------------------------------------------------------------------------------------
# Sharding, bucketing, seeds
# ----------------------------------------------------------------------------------------------
def test_process_shards_are_disjoint_and_complete():
    prompts = [rg.Prompt(f"id-{i}", [], i) for i in range(300)]
    for count in (1, 2, 3, 5):
        shards = [{p.id for p in rg.shard_prompts(prompts, i, count)} for i in range(count)]
        assert sum(map(len, shards)) == len(prompts)  # disjoint ...
        assert set().union(*shards) == {p.id for p in prompts}  # ... and complete
        assert min(map(len, shards)) > 0.6 * len(prompts) / count  # roughly balanced
    # The owner of a prompt does not depend on which other prompts exist.
    assert rg.shard_prompts(prompts[:10], 1, 3) == [p for p in rg.shard_prompts(prompts, 1, 3) if p.line < 10]
    with pytest.raises(ValueError, match="process_index"):
        rg.shard_prompts(prompts, 3, 3)
    assert rg.shard_output_path("d/out.jsonl", 1, 4).name == "out-00001-of-00004.jsonl"
    assert str(rg.shard_output_path("d/out.jsonl", 0, 1)) == "d/out.jsonl"


def test_length_buckets_cover_everything_and_cut_padding():
    rng = random.Random(0)
    lengths = [rng.randint(5, 500) for _ in range(203)]
    ids = [f"p{i}" for i in range(len(lengths))]
    batches = rg.plan_batches(ids, lengths, 8)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) == 8 for b in batches[:-1]) and len(batches[-1]) == 203 % 8
    # Sorted buckets: no batch's length range overlaps another's.
    spans = [(min(lengths[i] for i in b), max(lengths[i] for i in b)) for b in batches]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    # Each prompt is prefilled alone at its power-of-two bucket: 16 -> 0 waste, 17 -> 15 of 32.
    assert rg.padding_waste([16, 64], 512) == 0.0 and rg.padding_waste([17], 512) == 15 / 32
    assert rg.padding_waste([500], 512) == 12 / 512  # the last bucket is the cache length


def test_record_seed_depends_only_on_seed_and_id():
    assert rg.record_seed(0, "a") == rg.record_seed(0, "a")
    seeds = {rg.record_seed(s, i) for s in (0, 1) for i in ("a", "b", "c")}
    assert len(seeds) == 6 and all(0 <= s < 2 ** 31 for s in seeds)


# ----------------------------------------------------------------------------------------------
# Output file recovery
# ----------------------------------------------------------------------------------------------
def test_recover_output_drops_only_a_trailing_partial_line(tmp_path):
    out = tmp_path / "o.jsonl"
    full = b'{"id": "a"}\n{"id": "b"}\n'
    out.write_bytes(full + b'{"id": "c", "resp')
    assert [r["id"] for r in rg.recover_output(out)] == ["a", "b"]
    assert out.read_bytes() == full
    out.write_bytes(full + b'{"id": "c", "response_token_ids": [' + b"1, " * 900_000)  # > 1 MiB read-back chunk
    assert [r["id"] for r in rg.recover_output(out)] == ["a", "b"] and out.read_bytes() == full
    out.write_bytes(b'{"id": "a"}\ngarbage\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=":2: not a JSON record"):
        rg.recover_output(out)
    assert rg.recover_output(tmp_path / "missing.jsonl") == []


# ----------------------------------------------------------------------------------------------
# Runs through the engine (one tiny target, prompts in one length bucket: few compiles)
# ----------------------------------------------------------------------------------------------
SAMPLED = rg.GenerationSettings(temperature=0.7, top_p=0.8, top_k=20, max_new_tokens=10, seed=3)
GREEDY = rg.GenerationSettings.greedy(max_new_tokens=10, seed=3)
WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()


@pytest.fixture(scope="module")
def target(tokenizer):
    from d3d_jax.config import ModelConfig
    from d3d_jax.model.qwen3 import init_model

    cfg = ModelConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=256,
                      eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return init_model(cfg, seed=0)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    rng = random.Random(1)
    lines = []
    for i in range(11):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7)))
        fmt = i % 3
        if fmt == 0:
            lines.append(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": text},
                                                                 {"role": "assistant", "content": "old"}]}))
        elif fmt == 1:
            lines.append(json.dumps({"conversations": [{"from": "human", "value": text}]}))
        else:
            lines.append(json.dumps({"id": i, "prompt": text}))
    lines.insert(4, "{broken")
    return _write_lines(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", lines)


def _run(target, tokenizer, prompts, out, settings=SAMPLED, **kw):
    kw.setdefault("batch_size", 4)
    kw.setdefault("process_index", 0)
    kw.setdefault("process_count", 1)
    kw.setdefault("max_skipped_fraction", 0.1)  # the prompts file has 1 malformed line of 12
    return rg.regenerate(target, tokenizer, prompts, out, settings=settings, progress=False, **kw)


def _lines(path):
    return [json.loads(x) for x in open(path, encoding="utf-8")]


@pytest.fixture(scope="module")
def full_run(target, tokenizer, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "out.jsonl"
    summary = _run(target, tokenizer, prompts_file, out)
    return out, summary


def test_uninterrupted_run_writes_every_prompt_once(full_run, prompts_file, tokenizer):
    out, summary = full_run
    prompts, malformed = rg.read_prompts(prompts_file)
    records = _lines(out)
    assert sorted(r["id"] for r in records) == sorted(p.id for p in prompts)  # each exactly once
    assert summary.malformed == malformed and [n for n, _ in malformed] == [5]
    assert summary.written == 11 and summary.complete and "malformed prompt lines: 1" in summary.format()
    by_id = {p.id: p for p in prompts}
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for r in records:
        assert r["messages"] == by_id[r["id"]].messages
        assert r["prompt_token_ids"] == rg.render_prompt(tokenizer, r["messages"])
        assert r["response"] == tokenizer.decode(r["response_token_ids"], skip_special_tokens=True)
        assert r["generation"] == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_new_tokens": 10,
                                   "seed": 3}
        assert r["target"]["config_sha256"] and r["target"]["weights_sha256"]
        ids = r["response_token_ids"]
        if r["finish_reason"] == "eos":
            assert ids[-1] == eos and eos not in ids[:-1]
        else:
            assert r["finish_reason"] == "length" and len(ids) == 10 and eos not in ids
    assert summary.generated_tokens == sum(len(r["response_token_ids"]) for r in records)


def test_interrupted_then_resumed_equals_uninterrupted(full_run, target, tokenizer, prompts_file, tmp_path):
    out = tmp_path / "out.jsonl"
    first = _run(target, tokenizer, prompts_file, out, max_records=5)  # stops mid-batch (batches of 4)
    assert first.written == 5 and not first.complete and len(_lines(out)) == 5
    with open(out, "ab") as f:  # a crash in the middle of the next write
        f.write(b'{"id": "q9", "messages": [{"role": "us')
    second = _run(target, tokenizer, prompts_file, out)
    assert second.already_done == 5 and second.written == 6 and second.complete
    third = _run(target, tokenizer, prompts_file, out)  # nothing left to do
    assert third.written == 0 and third.already_done == 11
    resumed = _lines(out)
    assert len({r["id"] for r in resumed}) == len(resumed) == 11
    canon = lambda rs: sorted(json.dumps(r, sort_keys=True) for r in rs)  # noqa: E731
    assert canon(resumed) == canon(_lines(full_run[0]))


def test_damaged_records_are_not_done_but_set_aside_listed_and_regenerated(full_run, target, tokenizer,
                                                                          prompts_file, tmp_path):
    out = tmp_path / "out.jsonl"
    good = _lines(full_run[0])
    damaged = {0: "oops", 3: [1.5, 2.0], 6: [5, 10 ** 9]}  # a string, floats, an id past the vocabulary
    lines = []
    for i, r in enumerate(good):
        lines.append(json.dumps({**r, "response_token_ids": damaged[i]} if i in damaged else r))
    out.write_text("".join(x + "\n" for x in lines))
    summary = _run(target, tokenizer, prompts_file, out)
    assert summary.already_done == 8 and summary.written == 3 and summary.generated_tokens > 0
    listed = summary.invalid_records
    assert [n for n, _ in listed] == [1, 4, 7] and f"id {good[0]['id']!r}: 'response_token_ids' must be a list" in listed[0][1]
    assert "'response_token_ids'[0] is 1.5, not an integer" in listed[1][1] and "outside" in listed[2][1]
    assert "invalid output records set aside and regenerated: 3" in summary.format()
    resumed = _lines(out)
    assert len({r["id"] for r in resumed}) == len(resumed) == 11  # each id once: the bad lines moved out
    canon = lambda rs: sorted(json.dumps(r, sort_keys=True) for r in rs)  # noqa: E731
    assert canon(resumed) == canon(good)  # regenerated exactly as the uninterrupted run wrote them
    assert [json.loads(x)["response_token_ids"] for x in open(str(out) + ".invalid")] == list(damaged.values())


def test_resume_refuses_a_file_from_other_settings(full_run, target, tokenizer, prompts_file, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(open(full_run[0], "rb").readline())
    with pytest.raises(ValueError, match="generated with"):
        _run(target, tokenizer, prompts_file, out, settings=GREEDY)


def test_process_shards_are_disjoint_complete_and_batch_independent(full_run, target, tokenizer,
                                                                    prompts_file, tmp_path):
    shards = []
    for i in range(3):
        s = _run(target, tokenizer, prompts_file, tmp_path / "out.jsonl", process_index=i, process_count=3)
        shards.append(_lines(s.output))
        assert s.output.endswith(f"out-{i:05d}-of-00003.jsonl")
    ids = [r["id"] for shard in shards for r in shard]
    assert len(ids) == len(set(ids)) == 11  # disjoint and complete
    # Per-id seeds: the same records as the single-process run, although batches were composed differently.
    canon = lambda rs: sorted(json.dumps(r, sort_keys=True) for r in rs)  # noqa: E731
    assert canon([r for shard in shards for r in shard]) == canon(_lines(full_run[0]))
    # Merged into the one file training reads; every prompt accounted for.
    merged = rg.merge_shards(tmp_path / "out.jsonl", 3, prompts_file)
    assert merged["records"] == 11 and merged["missing"] == []
    assert canon(_lines(tmp_path / "out.jsonl")) == canon(_lines(full_run[0]))
    with open(rg.shard_output_path(tmp_path / "out.jsonl", 2, 3), "a") as f:
        f.write(json.dumps(shards[0][0]) + "\n")
    with pytest.raises(ValueError, match="is also in"):
        rg.merge_shards(tmp_path / "out.jsonl", 3)


def test_greedy_regeneration_equals_engine_plain_greedy(target, tokenizer, prompts_file, tmp_path):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from d3d_jax.decoding import engine

    out = tmp_path / "greedy.jsonl"
    _run(target, tokenizer, prompts_file, out, settings=GREEDY, batch_size=8)
    records = _lines(out)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = [r["prompt_token_ids"] for r in records]
    ref = Generator()(target, prompts, mode="plain", sampling=engine.SamplingParams(),
                          max_new_tokens=10, eos_token_ids=(eos,))
    assert [r["response_token_ids"] for r in records] == [o.token_ids for o in ref]
    assert [r["finish_reason"] for r in records] == [o.finish_reason for o in ref]
    # And both equal a brute-force argmax loop over full (uncached) causal forwards; the row is
    # right-padded to one fixed length (causal: padding after position t cannot change logit t).
    graphdef, params = nnx.split(target)
    forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
    for r in records[:3]:
        seq = list(r["prompt_token_ids"])
        for _ in range(10):
            row = np.zeros((1, 96), np.int32)
            row[0, :len(seq)] = seq
            nxt = int(jnp.argmax(forward(params, row)[0, len(seq) - 1]))
            seq.append(nxt)
            if nxt == eos:
                break
        assert seq[len(r["prompt_token_ids"]):] == r["response_token_ids"]


def _argmax_loop(target, prompts, n):
    """Brute-force greedy, ``n`` tokens per prompt: full (uncached) causal forwards, each row
    right-padded to 96 tokens (causal: padding after position t cannot change logit t)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    graphdef, params = nnx.split(target)
    forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
    outs = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(n):
            row = np.zeros((1, 96), np.int32)
            row[0, :len(seq)] = seq
            seq.append(int(jnp.argmax(forward(params, row)[0, len(seq) - 1])))
        outs.append(seq[len(prompt):])
    return outs


def test_continuous_batching_refills_finished_rows_with_each_prompts_own_tokens(target):
    """11 prompts through 3 rows, responses of mixed lengths: a finished row takes the next prompt
    while the others still run, and every output is the prompt's brute-force greedy decode alone."""
    from d3d_jax.decoding import engine

    rng = random.Random(5)  # random ids: this random model answers every chat prompt alike
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(3, 20))] for _ in range(11)]
    alone = _argmax_loop(target, prompts, 12)
    # the stop token that cuts the responses to the most different lengths: rows finish apart
    cut = lambda o, t: o[:o.index(t) + 1] if t in o else o  # noqa: E731
    stop = max(sorted({t for o in alone for t in o}), key=lambda t: len({len(cut(o, t)) for o in alone}))
    want = [cut(o, stop) for o in alone]
    assert len({len(w) for w in want}) >= 2
    # the shortest response beside the longest in the first rows: one finishes while one runs
    order = sorted(range(len(prompts)), key=lambda i: len(want[i]))
    order = [order[0], order[-1]] + order[1:-1]
    prompts, want = [prompts[i] for i in order], [want[i] for i in order]
    from d3d_jax.decoding.decoder import running_slots

    dec = engine.make_decoder(target, mode="plain", num_slots=3, max_cache_len=128)
    inserts, insert = [], dec.insert
    dec.insert = lambda prefix, slots: inserts.append(len(running_slots(dec))) or insert(prefix, slots)
    got = {}
    for finished in engine.generate_stream(dec, prompts, max_new_tokens=12, eos_token_ids=(stop,), refill=1):
        got.update({i: o.token_ids for i, o in finished})
    assert [got[i] for i in range(len(prompts))] == want
    assert max(inserts) > 0  # some row was admitted while another one still ran


def test_one_decoder_reads_the_target_in_place_for_every_prompt_length(target, tokenizer, prompts_file,
                                                                        tmp_path, monkeypatch):
    """Batches whose prompts pad to 3+ cache lengths share one decoder, bound to the target's own
    arrays (no copy of the weights per length), and write the tokens a one-length run writes."""
    import jax
    from flax import nnx

    from d3d_jax.decoding import engine

    built = []
    make = engine.make_decoder
    monkeypatch.setattr(engine, "make_decoder", lambda *a, **k: built.append(make(*a, **k)) or built[-1])
    one = tmp_path / "one.jsonl"
    _run(target, tokenizer, prompts_file, one, settings=GREEDY, batch_size=2, cache_multiple=256)
    many = tmp_path / "many.jsonl"
    _run(target, tokenizer, prompts_file, many, settings=GREEDY, batch_size=2, cache_multiple=4)
    lengths = [len(r["prompt_token_ids"]) for r in _lines(many)]
    assert len({rg._round_up(n, 4) for n in lengths}) >= 3  # the prompts span 3+ length buckets
    assert len(built) == 2  # one decoder per run, whatever the prompts' lengths
    own = {id(x) for x in jax.tree.leaves(nnx.state(target))}
    assert all(id(x) in own for x in built[1]._params[0])  # the target's arrays, not a copy
    by_id = {r["id"]: r["response_token_ids"] for r in _lines(one)}
    assert {r["id"]: r["response_token_ids"] for r in _lines(many)} == by_id


def test_records_load_in_training_pipeline_without_conversion(full_run, tokenizer):
    import numpy as np

    from d3d_jax.config import DataConfig
    from d3d_jax.training import data

    out = full_run[0]
    cfg = DataConfig(packed_length=128, num_anchors=2, block_size=4, batch_size=2, shuffle=False)
    examples, stats = data.load_examples(out, tokenizer, cfg)
    records = _lines(out)
    assert stats.kept == len(records) == len(examples)
    for ex, r in zip(examples, records):
        assert ex.response_start == len(r["prompt_token_ids"])
        np.testing.assert_array_equal(ex.tokens, r["prompt_token_ids"] + r["response_token_ids"])
        # The pipeline's own rendering from the messages gives the same prompt ids.
        assert data.render_prompt(tokenizer, r["messages"]) == r["prompt_token_ids"]
    ds, _ = data.build_dataset(cfg, str(out), tokenizer=tokenizer, mask_token_id=3)
    batch = ds[0]
    assert batch["tokens"].shape == (2, 128)
    first = records[0]["prompt_token_ids"] + records[0]["response_token_ids"]
    np.testing.assert_array_equal(batch["tokens"][0, :len(first)], first)


def test_cli_on_a_saved_sharded_target_matches_the_library(full_run, target, tokenizer, prompts_file, tmp_path):
    from pathlib import Path

    from d3d_jax.io.hf import save_qwen3

    target_dir = save_qwen3(target, tmp_path / "target")
    tokenizer.save_pretrained(target_dir)
    cli = _cli_module()
    out = tmp_path / "cli.jsonl"
    args = ["--target", str(target_dir), "--prompts", str(prompts_file), "--out", str(out), "--batch-size", "4",
            "--max-new-tokens", "10", "--seed", "3", "--process-count", "1", "--process-index", "0", "--no-progress"]
    # Each process loads the target onto its own devices: here 2 of the 8 test devices, fsdp-sharded.
    args += ["mesh.fsdp=2", "num_devices=2", "max_skipped_fraction=0.1"]
    assert cli.main(args + ["--max-records", "2"]) == 0
    assert cli.main(args) == 0  # resumes
    strip = lambda rs: sorted(json.dumps({k: v for k, v in r.items() if k != "target"}, sort_keys=True)  # noqa: E731
                              for r in rs)
    records = _lines(out)
    assert strip(records) == strip(_lines(full_run[0]))
    assert records[0]["target"]["path"] == str(Path(target_dir).resolve())
    with pytest.raises(Exception, match="top_p"):
        cli.main(args + ["top_p=1.5"])


def test_benchmark_reports_tokens_per_s_per_batch_size(target, tokenizer, prompts_file, tmp_path):
    from d3d_jax.bench import regenerate as bench

    rows = bench.benchmark_regeneration(target, tokenizer, prompts_file, batch_sizes=(1, 4), settings=SAMPLED,
                                        repeats=1, workdir=tmp_path)
    assert [r["batch_size"] for r in rows] == [1, 4]
    for r in rows:  # every prompt regenerated in the timed run, tokens counted from the records
        assert r["records"] == 11 and r["generated_tokens"] > 0 and r["tokens_per_s"] > 0
    # Same per-id seeds: both batch sizes sample the same responses, so the same token count.
    assert rows[0]["generated_tokens"] == rows[1]["generated_tokens"]
    table = bench.format_table(rows)
    assert "tokens/s" in table and len(table.splitlines()) == 3


# ----------------------------------------------------------------------------------------------
# Bad input: refused before any work, in one line
# ----------------------------------------------------------------------------------------------
def _cli_module():
    """train/regenerate_data.py as a module (its ``main`` runs in this process)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "regenerate_data", Path(__file__).resolve().parent.parent / "train" / "regenerate_data.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def test_cli_refuses_missing_tokenizer_and_limits_before_work(target, tokenizer, prompts_file, tmp_path, capsys):
    import subprocess

    from cli_util import assert_one_line_error, run_script
    from d3d_jax.cli import run_cli
    from d3d_jax.config import ModelConfig
    from d3d_jax.io.hf import save_qwen3
    from d3d_jax.model.qwen3 import init_model

    bare = save_qwen3(target, tmp_path / "bare")  # config.json and weights, no tokenizer
    out = tmp_path / "out.jsonl"
    args = ["--prompts", prompts_file, "--out", out, "--no-progress", "--max-new-tokens", 10,
            "max_skipped_fraction=0.1"]
    # the command as a user runs it (one process: its exit status and stderr)...
    assert_one_line_error(run_script("train/regenerate_data.py", "--target", bare, *args), 1,
                          f"{bare}: no tokenizer here", "(pass --tokenizer DIR)")
    main = _cli_module().main

    def in_process(*argv):  # ...the other refusals through the same run_cli, in this process
        capsys.readouterr()
        code = run_cli(main, [str(a) for a in argv])
        printed = capsys.readouterr()
        return subprocess.CompletedProcess(argv, code, printed.out, printed.err)

    tokenizer.save_pretrained(bare)
    assert_one_line_error(in_process("--target", bare, *args, "--max-new-tokens", 100000),
                          2, "max_new_tokens (100000) = 100001 exceeds max_position_embeddings 256")
    small = save_qwen3(init_model(ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=1,
                                              num_heads=2, num_kv_heads=1, head_dim=16)), tmp_path / "small")
    assert_one_line_error(in_process("--target", small, "--tokenizer", bare, *args), 1,
                          f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is 100")
    assert not out.exists()  # nothing was generated or written


def test_too_many_malformed_prompts_stop_before_generating(target, tokenizer, prompts_file, tmp_path):
    out = tmp_path / "out.jsonl"
    with pytest.raises(rg.DataError, match=r"1 of 12 records \(8.3%\) are invalid, more than "
                                           r"max_skipped_fraction=0.01 allows \(first: line 5: not valid JSON"):
        _run(target, tokenizer, prompts_file, out, max_skipped_fraction=0.01)
    with pytest.raises(rg.DataError, match="none of this shard's 11 prompts is usable .*tokens > 2"):
        _run(target, tokenizer, prompts_file, out, max_prompt_tokens=2)
    assert not out.exists()


def test_a_disk_filling_during_regeneration_is_one_line_and_the_rerun_completes(full_run, target, tokenizer,
                                                                                prompts_file, tmp_path):
    """A real write failure: the file-size limit (RLIMIT_FSIZE) stands in for a full disk."""
    import resource
    import signal

    from d3d_jax.errors import ResourceError

    out = tmp_path / "out.jsonl"
    limit = len(open(full_run[0], "rb").readline()) * 5 // 2  # room for two records of the first batch
    old_limit, old_handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        with pytest.raises(ResourceError) as e:
            _run(target, tokenizer, prompts_file, out)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert str(e.value).startswith(f"{out}: File too large (errno 27)") and "\n" not in str(e.value)
    summary = _run(target, tokenizer, prompts_file, out)  # the torn tail goes, the rest is resumed
    assert summary.written == 11 - summary.already_done and summary.complete
    canon = lambda rs: sorted(json.dumps(r, sort_keys=True) for r in rs)  # noqa: E731
    assert canon(_lines(out)) == canon(_lines(full_run[0]))


def test_sampling_defaults_come_from_the_targets_generation_config(tmp_path):
    from d3d_jax.config import RegenerateConfig, load_config

    # Qwen3-8B's generation_config.json as shipped
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95}))
    cfg = load_config(RegenerateConfig, [], ["top_p=0.5"])
    assert rg.settings_from_config(cfg, tmp_path) == rg.GenerationSettings(0.6, 0.5, 20, 512, 0)  # given wins
    assert rg.settings_from_config(cfg, tmp_path / "none") == rg.GenerationSettings(0.7, 0.5, 20, 512, 0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert rg.settings_from_config(load_config(RegenerateConfig, [], []), tmp_path).temperature == 0.0


def test_thinking_mode_renders_the_templates_thinking_prompt(target, tokenizer, prompts_file, tmp_path):
    out = tmp_path / "thinking.jsonl"
    _run(target, tokenizer, prompts_file, out, settings=GREEDY, enable_thinking=True, max_records=2)
    for r in _lines(out):
        text = tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
        assert r["prompt_token_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert "<think>" not in text and r["template"]["enable_thinking"] is True


def test_a_cpu_decodes_in_float32_unless_a_dtype_is_given():
    """XLA:CPU computes bfloat16 through float32 conversions (the KV cache's every round): a CPU
    regenerates in float32 by default; an accelerator keeps the stored dtype; a given one wins."""
    assert rg.compute_dtype(None, "cpu") == "float32"
    assert rg.compute_dtype(None, "gpu") is None and rg.compute_dtype(None, "tpu") is None
    assert rg.compute_dtype("bfloat16", "cpu") == "bfloat16"


def test_sigkill_mid_run_then_rerun_leaves_every_id_once(target, tokenizer, prompts_file, tmp_path):
    """The command SIGKILLed once some records are written (one row: records come one by one),
    then run again: every usable prompt's id is in the file exactly once, every record whole."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from d3d_jax.io.hf import save_qwen3

    target_dir = save_qwen3(target, tmp_path / "target")
    tokenizer.save_pretrained(target_dir)
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, str(root / "train" / "regenerate_data.py"), "--target", str(target_dir), "--prompts",
           str(prompts_file), "--out", str(out), "--batch-size", "1", "--max-new-tokens", "150",
           "--process-count", "1", "--process-index", "0", "--no-progress", "max_skipped_fraction=0.1"]
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None and not (out.exists() and out.read_bytes().count(b"\n") >= 2):
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    written = out.read_bytes().count(b"\n")
    assert proc.returncode == -signal.SIGKILL and 2 <= written < 11  # killed mid-run, not after the end
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    records = _lines(out)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) == 11
    assert all(rg.record_problem(r, target.config.vocab_size) is None for r in records)


def test_prompt_widths_are_the_cheapest_cover_of_the_lengths():
    """Against brute force over every set of candidate widths: padding plus a program each."""
    import itertools

    rng = random.Random(7)
    for _ in range(30):
        lengths = [rng.randint(1, 400) for _ in range(rng.randint(1, 12))]
        cost_of = rng.choice([0, 100, 1000, 8192])
        cands = sorted({rg._round_up(n, 64) for n in lengths})

        def cost(widths):
            return len(widths) * cost_of + sum(min(w for w in widths if w >= n) for n in lengths)

        best = min(cost(c) for r in range(1, len(cands) + 1) for c in itertools.combinations(cands, r)
                   if c[-1] == cands[-1])
        got = rg.prompt_widths(lengths, 64, cost_of)
        assert max(got) >= max(lengths) and all(w % 64 == 0 for w in got)
        assert cost(got) == best
    assert rg.prompt_widths([52, 100, 174]) == (192,)  # a few dozen short prompts: one program
    assert rg.prompt_widths([]) == ()


def test_the_tail_narrows_only_where_it_drops_many_rows():
    from d3d_jax.decoding import engine

    assert engine.tail_floor((1, 2, 4, 8), 8, 8) == 0  # 8 -> 2 rows: not worth a program
    assert engine.tail_floor((1, 2, 4, 8, 16, 32, 48), 40, 48) == 8  # 48 -> 8 rows
    assert engine.tail_floor((1, 2, 4, 8, 16, 32, 48), 8, 8) == 0
    assert engine.tail_floor((1, 2, 4, 8, 16, 32, 48), 3, 48) == 0


def test_a_run_compiles_one_admission_and_one_decode_loop(target, tokenizer, tmp_path, caplog):
    """Prompts of lengths across several power-of-two buckets and responses of mixed lengths at
    8 rows: one admission program (their one width) and one decode loop, nothing per bucket or
    for the tail."""
    import jax

    rng = random.Random(3)
    lines = [json.dumps({"id": f"p{i}", "prompt": " ".join(rng.choice(WORDS) for _ in range(n))})
             for i, n in enumerate([1, 2, 3, 9, 14, 20, 26, 30, 3, 1, 12])]
    prompts = _write_lines(tmp_path / "p.jsonl", lines)
    settings = rg.GenerationSettings(temperature=1.0, max_new_tokens=24, seed=5)
    out = tmp_path / "out.jsonl"
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        summary = _run(target, tokenizer, prompts, out, settings=settings, batch_size=8)
    lengths = [len(r["prompt_token_ids"]) for r in _lines(out)]
    assert summary.written == 11 and len({1 << (n - 1).bit_length() for n in lengths}) >= 3
    compiled = [r.getMessage() for r in caplog.records if "Finished XLA compilation" in r.getMessage()]
    assert sum("_admit_fn" in m for m in compiled) == 1, compiled
    assert sum("_loop_fn" in m for m in compiled) == 1, compiled
