"""Training data: every record is checked once before packing (types, 0 <= id < vocab,
UTF-8, JSON); a bad one is skipped and listed as file:line with the reason, too many stop the run
before its first step in one sentence, and a non-finite step stops training before its update."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cli_util import assert_one_line_error, run_script
from d3d_jax.config import DataConfig, TrainRunConfig, load_config
from d3d_jax.errors import DataError, NonFiniteError, RecordError, UsageError
from d3d_jax.training import data as D
from d3d_jax.training import objectives as obj
from d3d_jax.io import records
from d3d_jax.training.loop import Trainer, run

VOCAB = 64
GOOD = {"id": "g", "prompt_token_ids": [5, 6, 7], "response_token_ids": [8, 9, 10, 11]}
# Malformed records (ids outside the vocabulary, wrong types, broken UTF-8 or JSON), each with
# the counter it lands in and its reason.
BAD_LINES = [
    (json.dumps({**GOOD, "prompt_token_ids": [1000000]}).encode(), "bad_token_ids",
     "'prompt_token_ids'[0] = 1000000 is outside the vocabulary [0, 64)"),
    (json.dumps({**GOOD, "response_token_ids": [8, 64]}).encode(), "bad_token_ids",
     "'response_token_ids'[1] = 64 is outside the vocabulary [0, 64)"),
    (json.dumps({**GOOD, "prompt_token_ids": ["a"]}).encode(), "bad_token_ids",
     "'prompt_token_ids'[0] is 'a', not an integer token id"),
    (json.dumps({**GOOD, "prompt_token_ids": 5}).encode(), "missing_fields",
     "'prompt_token_ids' must be a list of token ids, got int"),
    (json.dumps({**GOOD, "prompt_token_ids": [2 ** 40]}).encode(), "bad_token_ids",
     "'prompt_token_ids'[0] = 1099511627776 is outside the vocabulary [0, 64)"),
    (json.dumps(GOOD).encode()[:20] + b"\xff" + json.dumps(GOOD).encode()[20:], "broken_lines",
     "byte 0xFF at column 21 is not UTF-8"),
    (json.dumps({**GOOD, "response_token_ids": [True, 9]}).encode(), "bad_token_ids",
     "'response_token_ids'[0] is True, not an integer token id"),
    (json.dumps({**GOOD, "response_token_ids": [8.0]}).encode(), "bad_token_ids", "is 8.0, not an integer"),
    (json.dumps({**GOOD, "prompt_token_ids": [-1]}).encode(), "bad_token_ids", "= -1 is outside"),
    (b'{"prompt_token_ids": [1], "response_token_ids": [' + b"9" * 5000 + b"]}", "broken_lines",
     "'response_token_ids[0]' is a number of 5,000 characters; numbers are read up to 100"),
    (json.dumps([GOOD]).encode(), "broken_lines", "a record must be a JSON object, got list"),
    (json.dumps({"prompt_token_ids": [5]}).encode(), "missing_fields", "no 'response_token_ids'"),
]


def test_a_long_number_anywhere_in_a_record_is_refused_by_its_key_unconverted():
    raw = b'{"prompt_token_ids": [1], "response_token_ids": [2], "meta": {"score": 1' + b"0" * 300 + b'.5}}'
    with pytest.raises(RecordError, match=r"^'meta.score' is a number of 303 characters"):
        records.decode_line(raw)


@pytest.mark.parametrize("raw,kind,reason", BAD_LINES)
def test_each_bad_record_is_one_record_error_with_its_reason(raw, kind, reason):
    with pytest.raises(RecordError) as e:
        records.training_record(records.decode_line(raw), VOCAB, need_messages=True)
    assert e.value.kind == kind and reason in str(e.value)
    ok = records.training_record(records.decode_line(json.dumps(GOOD).encode()), VOCAB, need_messages=True)
    assert ok.prompt.tolist() == [5, 6, 7] and ok.response.tolist() == [8, 9, 10, 11]
    assert ok.prompt.dtype == np.int32


def test_token_ids_agrees_with_a_brute_force_check():
    rng = np.random.default_rng(0)
    junk = [True, False, 1.0, "3", None, [1], {"a": 1}, 2 ** 31, 2 ** 63, 2 ** 70, -2 ** 70]
    for _ in range(400):
        value = [int(x) for x in rng.integers(-3, VOCAB + 3, int(rng.integers(0, 6)))]
        if rng.random() < 0.3:
            value.insert(int(rng.integers(0, len(value) + 1)), junk[int(rng.integers(len(junk)))])
        vocab = None if rng.random() < 0.2 else VOCAB
        limit = 2 ** 31 if vocab is None else vocab
        want = all(type(t) is int and 0 <= t < limit for t in value)
        try:
            got = records.token_ids(value, "ids", vocab)
            assert want and got.tolist() == value and got.dtype == np.int32
        except RecordError:
            assert not want, value


def _file(tmp_path, good, bad_at):
    """``good`` records with the raw ``bad_at[line] = bytes`` lines inserted (1-based lines)."""
    lines = [json.dumps(r).encode() for r in good]
    for line in sorted(bad_at):
        lines.insert(line - 1, bad_at[line])
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_bad_records_are_skipped_and_listed_with_file_line_and_reason(tmp_path):
    good = D.synthetic_records(400, vocab_size=VOCAB, response_len=20, seed=0)
    bad_at = {3 + 7 * i: raw for i, (raw, _, _) in enumerate(BAD_LINES)}
    path = _file(tmp_path, good, bad_at)
    cfg = DataConfig(packed_length=64 + 2 * 4, num_anchors=2, block_size=4, batch_size=4, max_skipped_fraction=0.03)
    examples, stats = D.load_examples(path, None, cfg, vocab_size=VOCAB)
    n_bad = len(BAD_LINES)
    assert stats.lines == 400 + n_bad and stats.kept == 400 and stats.invalid == n_bad
    for kind in ("broken_lines", "missing_fields", "bad_token_ids"):
        assert getattr(stats, kind) == sum(k == kind for _, k, _ in BAD_LINES)
    assert len(stats.skipped) == n_bad
    for entry, (line, (_, _, reason)) in zip(stats.skipped, sorted(zip(bad_at, BAD_LINES))):
        assert entry.startswith(f"{path}:{line}: ") and reason in entry
    for ex, rec in zip(examples, good):  # what is kept is exactly the good records, in order
        assert ex.tokens.tolist() == rec["prompt_token_ids"] + rec["response_token_ids"]
        assert ex.response_start == len(rec["prompt_token_ids"])
    # The same file under the default 1 %: the run stops, in one sentence naming the first bad line.
    with pytest.raises(DataError, match=rf"{n_bad} of {400 + n_bad} records \(2.9%\) are invalid, more than "
                                        rf"data.max_skipped_fraction=0.01 allows \(first: .*train.jsonl:3: "):
        D.load_examples(path, None, DataConfig(packed_length=72, num_anchors=2, block_size=4), vocab_size=VOCAB)


# ----------------------------------------------------------------------------------------------
# Through the trainer and its command line
# ----------------------------------------------------------------------------------------------
TINY = ["model.vocab_size=64", "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
        "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16", "model.max_position_embeddings=256",
        "data.packed_length=96", "data.num_anchors=4", "data.block_size=8", "data.batch_size=8",
        "data.mask_token_id=3", "data.dev_batches=0", "optim.name=adamw", "optim.warmup_steps=0",
        "train.progress_bar=false", "train.export_hf=false", "num_devices=1"]


def _cfg(path, out, *extra):
    return load_config(TrainRunConfig, [], TINY + [f"data.train_path={path}", f"train.out_dir={out}", *extra])


def test_one_out_of_vocab_record_in_65_stops_before_the_first_step_or_is_skipped(tmp_path):
    good = D.synthetic_records(64, vocab_size=VOCAB, response_len=40, seed=0)
    path = _file(tmp_path, good, {7: BAD_LINES[0][0]})
    with pytest.raises(DataError, match=r"1 of 65 records \(1.5%\) are invalid, .*train.jsonl:7: 'prompt_token_ids'"):
        Trainer(_cfg(path, tmp_path / "stopped"))
    assert not (tmp_path / "stopped" / "metrics.jsonl").exists()
    # Allowed a few bad records, the run trains on the 64 good ones and reports the skipped one.
    path = _file(tmp_path, good, {7: BAD_LINES[0][0], 30: BAD_LINES[1][0]})
    out = tmp_path / "trained"
    tr = run(_cfg(path, out, "data.max_skipped_fraction=0.05", "train.steps=3", "train.log_every=1"))
    assert tr.data_stats["train"]["bad_token_ids"] == 2 and tr.data_stats["train"]["kept"] == 64
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    skipped = lines[0]["data_stats"]["train"]["skipped"]
    assert skipped[0].endswith("train.jsonl:7: 'prompt_token_ids'[0] = 1000000 is outside the vocabulary [0, 64)")
    assert "train.jsonl:30: 'response_token_ids'[1] = 64" in skipped[1]
    assert all(np.isfinite(r["loss"]) for r in lines if "loss" in r)
    from d3d_jax.io.checkpoint import load_model
    from flax import nnx

    exported = load_model(out / "export" / "params")
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(exported, nnx.Param)))


def test_train_cli_refuses_bad_data_in_one_line(tmp_path):
    path = _file(tmp_path, D.synthetic_records(64, vocab_size=VOCAB, seed=0), {7: BAD_LINES[2][0]})
    out = run_script("train/train_drafter.py", *TINY, f"data.train_path={path}", f"train.out_dir={tmp_path}/run")
    assert_one_line_error(out, 1, "1 of 65 records", "train.jsonl:7: 'prompt_token_ids'[0] is 'a'")
    assert not (tmp_path / "run" / "export").exists()


POISON = VOCAB - 1  # synthetic records with vocab_size VOCAB - 1 never contain it


def test_nonfinite_step_stops_before_its_update_and_names_its_records(tmp_path):
    recs = D.synthetic_records(64, vocab_size=VOCAB - 1, response_len=40, seed=0)
    path = D.write_jsonl(tmp_path / "train.jsonl", recs)
    cfg = _cfg(path, tmp_path / "run", "train.steps=8", "train.log_every=0", "train.checkpoint_every=2",
               "train.async_checkpointing=false")
    # Step 3 trains on batch 2 (the order depends on indices only): poison one of its records.
    ds, _ = D.build_dataset(cfg.data, str(path), mask_token_id=3, vocab_size=VOCAB)
    lines3 = sorted(int(n) for n in ds[2][D.RECORD_LINE])
    recs[lines3[0] - 1]["response_token_ids"][5] = POISON
    D.write_jsonl(path, recs)
    base = obj.make_loss_fn(cfg.objective)

    def loss_fn(model, batch):  # a fault: NaN loss and gradients on the poisoned batch only
        loss, m = base(model, batch)
        loss = loss * jnp.where(jnp.any(batch["tokens"] == POISON), jnp.nan, 1.0)
        return loss, {**m, "loss": loss}

    tr = Trainer(cfg, loss_fn=loss_fn)
    with pytest.raises(NonFiniteError) as e:
        tr.fit()
    msg = str(e.value)
    assert msg.startswith("step 3: the loss or gradient norm is not finite") and "last good checkpoint is step 2" in msg
    for n in lines3:
        assert f"{path}:{n} (id 'synthetic-{n - 1}')" in msg
    # Neither step 3's update nor the clean step 4 that ran before the host looked was applied.
    assert tr.step == 2 and int(tr.state["step"]) == 2 and tr.checkpointer.latest_step() == 2
    saved, _ = tr.checkpointer.restore(2, tr.state)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(tr.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and last["stopped"] == msg
    tr.check_finite()  # reported once; the state in memory is the last good step's
    tr.close()


def test_train_cli_stops_on_a_diverging_run_with_exit_1(tmp_path):
    # A learning rate of 1e30 makes step 1's weights ~1e30, so step 2's forward overflows.
    path = D.write_jsonl(tmp_path / "train.jsonl", D.synthetic_records(64, vocab_size=VOCAB, seed=0))
    out = run_script("train/train_drafter.py", *TINY, f"data.train_path={path}", f"train.out_dir={tmp_path}/run",
                     "optim.learning_rate=1e30", "optim.final_learning_rate=1e30", "train.steps=4",
                     "train.checkpoint_every=1", "train.async_checkpointing=false")
    assert_one_line_error(out, 1, "step 2: the loss or gradient norm is not finite",
                          "last good checkpoint is step 1", f"{path}:")
    assert not (tmp_path / "run" / "export").exists()


def test_context_limit_is_checked_before_work():
    records.check_context(10, 246, 256)  # fits exactly
    with pytest.raises(UsageError, match=r"prompt \(10 tokens\) \+ max_new_tokens \(100000\) = 100010 exceeds "
                                         r"max_position_embeddings 256 of m; lower max_new_tokens or pass --x"):
        records.check_context(10, 100000, 256, model="m", hint="--x")
    records.check_context(10, 100000, 256, allow_beyond=True)


def test_eval_entry_point_checks_context_and_branch_budget_before_decoding():
    import types

    from d3d_jax.bench.evaluation.cli import check_limits
    from d3d_jax.config import ConfigError, EvalConfig, load_config

    target = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=256, context_length=256))
    base = ["models.target=t", "models.drafter=d", "eval.max_new_tokens=300", "decoder.branch_fanout=64"]
    cfg = load_config(EvalConfig, [], base + ["eval.modes=plain,async"])
    with pytest.raises(UsageError, match=r"= 310 exceeds max_position_embeddings 256 of --target t"):
        check_limits(cfg, target, 10, 16)
    check_limits(load_config(EvalConfig, [], base + ["eval.allow_beyond_context=true", "eval.modes=plain,sync"]),
                 target, 10, 16)
    cfg = load_config(EvalConfig, [], base + ["eval.allow_beyond_context=true", "eval.modes=plain,async"])
    with pytest.raises(ConfigError, match=r"16·\(\(12-1\)·64 \+ 2\) = 11296 tokens"):
        check_limits(cfg, target, 10, 16)
