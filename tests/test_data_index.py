"""Training records by a cached index: the same epoch as reading every line, each process reading
only its rows' records.  Reference: ``load_examples`` (every line read, checked and tokenised)."""
import json
import os

import numpy as np
import pytest

from d3d_jax.config import DataConfig
from d3d_jax.errors import DataError
from d3d_jax.io.records import write_jsonl
from d3d_jax.training import data as D
from d3d_jax.training import data_index as I

VOCAB = 64
CFG = DataConfig(packed_length=40 + 2 * 4, num_anchors=2, block_size=4, batch_size=4, shuffle=False,
                 max_skipped_fraction=0.5)


def _corpus(tmp_path):
    """Three shards (two gzipped) with the kinds of bad record the loader skips or truncates."""
    recs = D.synthetic_records(30, vocab_size=VOCAB, response_len=20, seed=4)
    recs[3]["response_token_ids"] = []  # empty
    recs[7]["response_token_ids"][2] = VOCAB + 5  # outside the vocabulary
    recs[12]["prompt_token_ids"] = list(range(4, 44))  # prompt fills the clean stream
    recs[13]["response_token_ids"] = list(range(4, 60))  # truncated
    del recs[21]["response_token_ids"]  # missing
    recs[25]["response_token_ids"] = recs[25]["response_token_ids"][:2]  # no full block
    write_jsonl(tmp_path / "a.jsonl", recs[:10])
    write_jsonl(tmp_path / "b.jsonl.gz", recs[10:20])
    lines = [json.dumps(r).encode() for r in recs[20:]]
    lines.insert(4, b"{not json")
    import gzip

    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(b"\n".join(lines) + b"\n\n"))
    return [tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz", tmp_path / "c.jsonl.gz"]


def _reference(files, cfg=CFG):
    out, stats = [], []
    for i, f in enumerate(files):
        ex, st = D.load_examples(f, None, cfg, vocab_size=VOCAB)
        out += [(i, e) for e in ex]
        stats.append(st)
    return out, stats


def test_an_epoch_holds_what_reading_every_line_holds(tmp_path):
    files = _corpus(tmp_path)
    want, ref_stats = _reference(files)
    examples, stats = D.indexed_examples(f"{tmp_path}/a.jsonl,{tmp_path}/*.gz", None, CFG, VOCAB)
    assert len(examples) == len(want) == stats.kept
    for k, (i, e) in enumerate(want):
        got = examples[k]
        assert (got.file, got.line, got.response_start) == (i, e.line, e.response_start)
        np.testing.assert_array_equal(got.tokens, e.tokens)
    for key in ("lines", "kept", "broken_lines", "missing_fields", "bad_token_ids", "truncated", "empty_response",
                "without_anchor"):
        assert getattr(stats, key) == sum(getattr(s, key) for s in ref_stats), key
    assert stats.skipped == [s for st in ref_stats for s in st.skipped]


def test_the_index_is_built_once_and_again_when_its_file_changes(tmp_path, monkeypatch):
    files = _corpus(tmp_path)
    I.corpus_index(str(files[1]))
    built = []
    monkeypatch.setattr(I, "_build", lambda path, base, _b=I._build: (built.append(path), _b(path, base)))
    I.corpus_index(str(files[1]))
    assert built == []
    recs = D.synthetic_records(3, vocab_size=VOCAB, seed=9)
    write_jsonl(files[1], recs)
    os.utime(files[1], ns=(1, 1))  # a stale mtime alone makes it stale too
    idx = I.corpus_index(str(files[1]))
    assert built == [files[1]] and len(idx) == 3


def test_each_process_reads_only_its_rows_records(tmp_path, monkeypatch):
    files = _corpus(tmp_path)
    reads = []
    monkeypatch.setattr(I.RecordReader, "read", lambda self, k, _r=I.RecordReader.read: (reads.append(k), _r(self, k))[1])
    spec = ",".join(map(str, files))
    cfg = DataConfig(**{**CFG.__dict__, "shuffle": True})
    whole, _ = D.build_dataset(cfg, spec, mask_token_id=3, vocab_size=VOCAB)
    reads.clear()  # the selection re-reads the suspect records once; rows read theirs on demand
    part, _ = D.build_dataset(cfg, spec, mask_token_id=3, vocab_size=VOCAB, shard=(1, 2))
    reads.clear()
    got = part[5]
    assert len(reads) == 2  # batch_size 4 over 2 processes: two records read, not the corpus
    np.testing.assert_array_equal(got["tokens"], whole[5]["tokens"][2:])
    assert set(whole[5][D.RECORD_FILE]) <= {0, 1, 2}


def test_names_that_match_nothing_or_are_not_records_fail_in_one_line(tmp_path):
    with pytest.raises(DataError, match="no file matches"):
        I.expand_paths(f"{tmp_path}/*.jsonl")
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match="parquet is not read"):
        I.expand_paths(f"{tmp_path}/x.parquet")
    with pytest.raises(FileNotFoundError, match="No such file"):
        I.expand_paths(f"{tmp_path}/missing.jsonl")


def test_worker_processes_read_the_same_batches_and_resume_from_their_state(tmp_path):
    files = _corpus(tmp_path)
    cfg = DataConfig(**{**CFG.__dict__, "shuffle": True})
    ds, _ = D.build_dataset(cfg, ",".join(map(str, files)), mask_token_id=3, vocab_size=VOCAB, shard=(0, 2))
    it = D.iterate(ds, worker_count=2)
    got = [next(it) for _ in range(3)]
    state = it.get_state()
    again = D.iterate(ds, worker_count=2)
    again.set_state(state)
    for i, b in enumerate(got + [next(again)]):
        np.testing.assert_array_equal(b["tokens"], ds[i]["tokens"])


def test_a_failed_step_names_its_records_by_file_and_line(tmp_path):
    from d3d_jax.training.loop import nonfinite_message

    files = _corpus(tmp_path)
    lines, which = np.asarray([2, 5, 3]), np.asarray([0, 2, 2])
    msg = nonfinite_message(7, (lines, which), f"{tmp_path}/a.jsonl,{tmp_path}/*.gz", None)
    assert f"{files[0]}:2 (id 'synthetic-1')" in msg and f"{files[2]}:3 (id 'synthetic-22')" in msg
    assert f"{files[2]}:5" in msg and f"{files[2]}:5 (id" not in msg  # line 5 of c is not JSON: no id
