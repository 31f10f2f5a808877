"""Packing and the grain pipeline vs spec §2.1-2.3 brute force."""
import gzip
import json

import jax.numpy as jnp
import numpy as np
import pytest

from d3d_jax.config import DataConfig
from d3d_jax.errors import DataError
from d3d_jax.model.masks import attention_mask
from d3d_jax.training import data as D

MASK = 3


def _spec_mask(ex_len, S, anchors, valid, B, L):
    """Spec §2.3 by hand: clean i sees clean j <= i; block b sees clean j < a_b and its own block."""
    m = np.zeros((L, L), bool)
    for i in range(ex_len):
        m[i, :i + 1] = True
    for b, (a, ok) in enumerate(zip(anchors, valid)):
        if not ok:
            continue
        rows = range(S + b * B, S + (b + 1) * B)
        for q in rows:
            m[q, :min(a, ex_len)] = True
            m[q, S + b * B:S + (b + 1) * B] = True
    return m


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_mask_equals_spec_brute_force(seed):
    rng = np.random.default_rng(seed)
    cfg = DataConfig(packed_length=40 + 5 * 4, num_anchors=5, block_size=4)
    n = int(rng.integers(12, 40))
    rs = int(rng.integers(1, n - 4))
    ex = D.Example(rng.integers(4, 50, n).astype(np.int32), rs)
    anchors, valid = D.sample_anchors(rng, rs, n, cfg.num_anchors, cfg.block_size)
    row = D.pack_example(ex, anchors, valid, cfg, MASK)
    meta = D.batch_meta({k: v[None] for k, v in row.items()})
    got = np.asarray(attention_mask(meta, meta))[0]
    want = _spec_mask(n, cfg.clean_length, anchors, valid, cfg.block_size, cfg.packed_length)
    np.testing.assert_array_equal(got, want)
    # block tokens: [x[a], MASK...] at positions a..a+B-1
    for b in np.flatnonzero(valid):
        sl = slice(cfg.clean_length + b * 4, cfg.clean_length + b * 4 + 4)
        assert list(row["tokens"][sl]) == [ex.tokens[anchors[b]], MASK, MASK, MASK]
        assert list(row["positions"][sl]) == list(anchors[b] + np.arange(4))


def test_anchors_inside_response_and_loss_only_on_response():
    rng = np.random.default_rng(0)
    B = 16
    cfg = DataConfig(packed_length=200 + 8 * B, num_anchors=8, block_size=B)
    for _ in range(200):
        n = int(rng.integers(2, 200))
        rs = int(rng.integers(0, n))
        ex = D.Example(rng.integers(4, 50, n).astype(np.int32), rs)
        anchors, valid = D.sample_anchors(rng, rs, n, cfg.num_anchors, B)
        a = anchors[valid]
        assert np.all(a >= rs) and np.all(a + B - 1 < n)  # full blocks inside the response
        assert np.all(np.diff(a) > 0)  # sorted, without replacement
        assert valid.sum() == min(8, max(0, n - B - rs + 1))
        row = D.pack_example(ex, anchors, valid, cfg, MASK)
        # Every position carrying loss predicts a response token (index >= rs).
        ar_idx = np.flatnonzero(row["ar_mask"])
        assert np.all(ar_idx + 1 >= rs) and np.all(ar_idx + 1 < n)
        assert len(ar_idx) == n - max(rs, 1)
        for i in ar_idx:
            assert row["labels"][i] == ex.tokens[i + 1]
        for b in np.flatnonzero(valid):
            base = cfg.clean_length + b * B
            assert list(row["slot"][base:base + B]) == list(range(B))
            assert list(row["labels"][base:base + B]) == list(ex.tokens[anchors[b]:anchors[b] + B])
        assert np.all(row["slot"][cfg.clean_length:].reshape(8, B)[~valid] == -1)
        assert np.all(row["slot"][:cfg.clean_length] == -1)


def _write_jsonl(path, recs, extra_lines=()):
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")


def test_jsonl_counts_and_determinism(tmp_path):
    recs = [{"id": i, "prompt_token_ids": [5, 6, 7], "response_token_ids": list(range(10, 10 + 8 + i))}
            for i in range(10)]
    recs.append({"id": "long", "prompt_token_ids": [5] * 4, "response_token_ids": list(range(40))})
    recs.append({"id": "nofield", "messages": [{"role": "user", "content": "x"}]})
    recs.append({"id": "empty", "prompt_token_ids": [5], "response_token_ids": []})
    path = tmp_path / "d.jsonl"
    _write_jsonl(path, recs, extra_lines=["{not json", "[1, 2"])
    cfg = DataConfig(packed_length=24 + 2 * 4, num_anchors=2, block_size=4, batch_size=3, seed=7,
                     max_skipped_fraction=0.2)
    ds, stats = D.build_dataset(cfg, str(path), mask_token_id=MASK)
    assert stats.broken_lines == 2 and stats.missing_fields == 1 and stats.empty_response == 1
    assert stats.truncated == 1 and stats.kept == 11 and stats.lines == 15
    assert stats.skipped == [f"{path}:12: no 'response_token_ids'", f"{path}:14: not valid JSON "
                             "(Expecting property name enclosed in double quotes at column 2)",
                             f"{path}:15: not valid JSON (Expecting ',' delimiter at column 6)"]
    # every row names the line of its record: the record with id i is on line i + 1
    b = ds[0]
    for row in range(3):
        r = recs[int(b[D.RECORD_LINE][row]) - 1]
        want = (r["prompt_token_ids"] + r["response_token_ids"])[:24]
        np.testing.assert_array_equal(b["tokens"][row, :len(want)], want)
    with pytest.raises(DataError, match=r"3 of 15 records \(20.0%\) are invalid, more than "
                                        r"data.max_skipped_fraction=0.1 allows \(first: .*d.jsonl:12"):
        D.build_dataset(DataConfig(**{**cfg.__dict__, "max_skipped_fraction": 0.1}), str(path), mask_token_id=MASK)
    b0 = ds[0]
    assert b0["tokens"].shape == (3, 32) and b0["anchors"].shape == (3, 2)
    # same seed -> same batches; another seed -> other order/anchors
    ds2, _ = D.build_dataset(cfg, str(path), mask_token_id=MASK)
    ds3, _ = D.build_dataset(DataConfig(**{**cfg.__dict__, "seed": 8}), str(path), mask_token_id=MASK)
    for i in range(5):
        for k in b0:
            np.testing.assert_array_equal(ds[i][k], ds2[i][k])
    assert any(not np.array_equal(ds[i]["tokens"], ds3[i]["tokens"]) for i in range(5))
    # iterator state round-trip (what the checkpoint stores)
    it = ds.to_iter_dataset().__iter__()
    next(it), next(it)
    state = it.get_state()
    want = [next(it)["tokens"] for _ in range(3)]
    it2 = ds2.to_iter_dataset().__iter__()
    it2.set_state(state)
    for w in want:
        np.testing.assert_array_equal(next(it2)["tokens"], w)


def test_chat_template_rendering(tmp_path):
    from transformers import AutoTokenizer

    from d3d_jax.demo.tokenizer import train_tokenizer

    tok_dir = train_tokenizer(["hello world, the drafter drafts. " * 20], 300, tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    msgs = [{"role": "user", "content": "hello world"}]
    ids = D.render_prompt(tok, msgs)
    assert tok.decode(ids) == ("<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
                               "<think>\n\n</think>\n\n")
    resp = tok("the drafter", add_special_tokens=False)["input_ids"]
    cfg = DataConfig(packed_length=64 + 4, num_anchors=1, block_size=4)
    ex = D.record_to_example({"messages": msgs, "response_token_ids": resp}, tok, cfg.clean_length, D.DataStats())
    assert list(ex.tokens) == ids + resp and ex.response_start == len(ids)
    assert D.resolve_mask_token_id(cfg, None, tok) == tok.convert_tokens_to_ids("<|MASK|>")


def test_lm_rows(tmp_path):
    path = tmp_path / "lm.jsonl"
    _write_jsonl(path, [{"token_ids": list(range(1, 30))}, {"token_ids": [7, 8, 9]}, {"bad": 1}])
    cfg = DataConfig(mode="lm", packed_length=8, batch_size=2, shuffle=False, max_skipped_fraction=0.5)
    ds, stats = D.build_dataset(cfg, str(path), eos_token_id=0)
    assert stats.missing_fields == 1 and stats.kept == 2
    assert stats.skipped == [f"{path}:3: needs 'token_ids' (a list of ids) or 'text' (a string)"]
    stream, _ = D.load_lm_stream(path, None, 0, max_skipped_fraction=0.5)
    assert [stream.line_at(o) for o in (0, 29, 30, 33)] == [1, 1, 2, 2]  # doc 1 is 29 ids + eos
    np.testing.assert_array_equal(ds[0][D.RECORD_LINE], [1, 1])
    stream = list(range(1, 30)) + [0, 7, 8, 9, 0]
    b = ds[0]
    np.testing.assert_array_equal(b["tokens"][0], stream[0:8])
    np.testing.assert_array_equal(b["labels"][0], stream[1:9])
    np.testing.assert_array_equal(b["tokens"][1], stream[8:16])
    assert b["ar_mask"].all() and (b["slot"] == -1).all()
    meta = D.batch_meta(b)
    m = np.asarray(attention_mask(meta, meta))[0]
    np.testing.assert_array_equal(m, np.tril(np.ones((8, 8), bool)))


def test_process_shards_split_every_global_batch(tmp_path):
    """n processes' rows of a batch, stacked in process order, are the 1-process batch, row for row
    (records, anchors and all), and no process sees another's rows."""
    recs = [{"id": i, "prompt_token_ids": [5], "response_token_ids": [10 + i] * 6} for i in range(12)]
    _write_jsonl(tmp_path / "d.jsonl", recs)
    cfg = DataConfig(packed_length=8 + 1 * 4, num_anchors=1, block_size=4, batch_size=6, shuffle=True)
    one, _ = D.build_dataset(cfg, str(tmp_path / "d.jsonl"), mask_token_id=MASK)
    for n in (2, 3):
        parts = [D.build_dataset(cfg, str(tmp_path / "d.jsonl"), mask_token_id=MASK, shard=(i, n))[0]
                 for i in range(n)]
        for j in range(3):  # across an epoch boundary (12 records = 2 batches)
            for k, v in one[j].items():
                np.testing.assert_array_equal(np.concatenate([p[j][k] for p in parts]), v, err_msg=k)
            ids = [{int(t) - 10 for t in p[j]["tokens"][:, 1]} for p in parts]
            assert all(len(x) == 6 // n for x in ids) and not set.intersection(*ids)
    with pytest.raises(ValueError, match="batch_size=6 is not divisible by the 4 processes"):
        D.build_dataset(cfg, str(tmp_path / "d.jsonl"), mask_token_id=MASK, shard=(0, 4))


def test_first_block_anchor_on_the_last_prompt_token(tmp_path):
    """data.first_block_anchor: the last prompt token (decoding's first anchor) becomes eligible, its
    block is full and its slots 1..B-1 are the response's first B-1 tokens; off, anchors stay >= rs."""
    B = 4
    # prompt 3 tokens; responses of B-1 tokens (only the first block fits) up to 9 tokens
    recs = [{"id": i, "prompt_token_ids": [5, 6, 7], "response_token_ids": list(range(20, 20 + B - 1 + i))}
            for i in range(7)]
    _write_jsonl(tmp_path / "d.jsonl", recs)
    for on in (False, True):
        cfg = DataConfig(packed_length=16 + 8 * B, num_anchors=8, block_size=B, batch_size=7, shuffle=False,
                         first_block_anchor=on)
        ds, stats = D.build_dataset(cfg, str(tmp_path / "d.jsonl"), mask_token_id=MASK)
        assert stats.without_anchor == (0 if on else 1)
        b = ds[0]
        for r in range(7):
            n, rs = 3 + B - 1 + r, 3
            a = b["anchors"][r][b["anchor_valid"][r]]
            lo = rs - 1 if on else rs
            assert len(a) == min(8, n - B - lo + 1)  # every eligible position, each once
            assert np.all(a >= lo) and np.all(a + B - 1 < n)
            first = np.flatnonzero(b["anchor_valid"][r] & (b["anchors"][r] == rs - 1))
            assert len(first) == (1 if on else 0)
            if on:
                base = cfg.clean_length + int(first[0]) * B
                assert list(b["tokens"][r, base:base + B]) == [7] + [MASK] * (B - 1)
                assert list(b["labels"][r, base + 1:base + B]) == recs[r]["response_token_ids"][:B - 1]
                assert list(b["slot"][r, base:base + B]) == list(range(B))


def test_a_byte_order_mark_does_not_drop_the_first_record(tmp_path):
    recs = D.synthetic_records(3, vocab_size=64, seed=2)
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(json.dumps(r).encode() + b"\n" for r in recs))  # Notepad's UTF-8
    cfg = DataConfig(packed_length=96, num_anchors=2, block_size=4)
    examples, stats = D.load_examples(path, None, cfg, vocab_size=64)
    assert stats.kept == 3 and stats.invalid == 0, stats.skipped
    assert examples[0].line == 1 and examples[0].tokens[0] == recs[0]["prompt_token_ids"][0]


def test_a_gzipped_jsonl_reads_as_the_plain_one_and_writes_the_same_bytes_every_time(tmp_path):
    from d3d_jax.io.records import write_jsonl

    recs = D.synthetic_records(5, vocab_size=64, seed=3)
    plain, packed = tmp_path / "r.jsonl", tmp_path / "r.jsonl.gz"
    write_jsonl(plain, recs)
    write_jsonl(packed, recs)
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    first = packed.read_bytes()
    write_jsonl(packed, iter(recs))  # no name or time in the header: the same bytes
    assert packed.read_bytes() == first
    cfg = DataConfig(packed_length=96, num_anchors=2, block_size=4)
    a, sa = D.load_examples(plain, None, cfg, vocab_size=64)
    b, sb = D.load_examples(packed, None, cfg, vocab_size=64)
    assert sa.kept == sb.kept == 5 and [e.line for e in a] == [e.line for e in b]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.tokens, y.tokens)
    # an LM stream of token_ids documents, too (the suffix is .gz, the content JSONL)
    docs = tmp_path / "lm.jsonl.gz"
    write_jsonl(docs, [{"token_ids": [3, 4, 5]}, {"token_ids": [6]}])
    stream, stats = D.load_lm_stream(docs, None, eos_token_id=1, vocab_size=64)
    assert stats.lines == 2
