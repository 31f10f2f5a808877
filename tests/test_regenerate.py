"""Regeneration (spec §2.1): prompt formats, sharding, bucketing, resume, and runs through the engine."""

import json
import random

import pytest

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

    from d3d_jax.io.tokenizer import train_tokenizer

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
    in_file_order = [list(range(i, min(i + 8, len(lengths)))) for i in range(0, len(lengths), 8)]
    assert rg.padding_waste(lengths, batches) < 0.1 < rg.padding_waste(lengths, in_file_order)


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
    out.write_bytes(b'{"id": "a"}\ngarbage\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=":2: not a JSON record"):
        rg.recover_output(out)
    assert rg.recover_output(tmp_path / "missing.jsonl") == []
