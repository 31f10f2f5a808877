"""The demo package (d3d_jax/demo/): the embedded tokenizer: an HF directory AutoTokenizer loads, lossless on unseen text, chat template."""
import numpy as np
import pytest
from transformers import AutoTokenizer

from d3d_jax.demo import corpus as K
from d3d_jax.demo import tokenizer as T


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    docs = K.load_corpus("pretrain", max_chars=300_000)
    return T.train_tokenizer(docs, 600, tmp_path_factory.mktemp("tok"))


def test_autotokenizer_loads_with_special_tokens(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert len(tok) == 600
    ids = tok.convert_tokens_to_ids(list(T.SPECIAL_TOKENS))
    assert ids == list(range(len(T.SPECIAL_TOKENS)))  # fixed low ids, any vocab size
    assert tok.eos_token == T.IM_END and tok.pad_token == T.ENDOFTEXT
    # Special tokens are atomic: the string "<|MASK|>" encodes to exactly one id.
    assert tok("a<|MASK|>b")["input_ids"].count(ids[3]) == 1


def test_roundtrip_on_held_out_text_and_unseen_bytes(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    held_out = K.load_corpus("eval", max_chars=20_000)
    assert held_out
    for text in held_out + ["naïve café — 日本語 🙂\n\t\tx = 1\r\n"]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    # BPE learned something: fewer tokens than bytes on held-out English and code.
    sample = "".join(held_out)[:5000]
    assert len(tok(sample)["input_ids"]) < 0.6 * len(sample.encode())


def test_chat_template_matches_chatml_and_honours_enable_thinking(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "def f():"}]
    chatml = ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
              "<|im_start|>user\ndef f():<|im_end|>\n<|im_start|>assistant\n")
    no_think = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
    assert no_think == chatml + "<think>\n\n</think>\n\n"
    think = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert think == chatml
    assert tok.apply_chat_template(msgs, tokenize=False) == chatml[: -len("<|im_start|>assistant\n")]


def test_corpus_splits_are_disjoint_and_nonempty():
    for src_files in (K.shakespeare_files, K.stdlib_files):
        splits = {s: set(src_files(s)) for s in K.SPLITS}
        assert all(splits.values())
        assert not (splits["pretrain"] & splits["prompts"]) and not (splits["pretrain"] & splits["eval"])
        assert not (splits["prompts"] & splits["eval"])
    names = {K.play_name(f) for f in K.shakespeare_files("pretrain")}
    assert not names & set(K.EVAL_PLAYS + K.PROMPT_PLAYS)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="vocab_size"):
        T.train_tokenizer(["abc"], 100, "/tmp/unused_tok")
    with pytest.raises(ValueError, match="split"):
        K.load_corpus("train")
    with pytest.raises(ValueError, match="source"):
        K.load_corpus("pretrain", sources=("wikipedia",))


# ---------------------------------------------------------------------------------------
# Split rules: no evaluation prompt, nor any 64-token window of one, in the training text
# ---------------------------------------------------------------------------------------
WINDOW = 64


def _window_hashes(ids: np.ndarray, n: int = WINDOW) -> np.ndarray:
    """Polynomial hash (mod 2^64) of every n-token window of ``ids``."""
    ids = ids.astype(np.uint64)
    if len(ids) < n:
        return np.zeros(0, np.uint64)
    h = np.zeros(len(ids) - n + 1, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * np.uint64(1_000_003) + ids[j:len(ids) - n + 1 + j]
    return h


def shared_windows(eval_ids: list[list[int]], train_ids: list[list[int]], n: int = WINDOW) -> list[tuple[int, int]]:
    """``(eval prompt, train text)`` pairs sharing an n-token window, confirmed token by token.

    The training texts are hashed as one array with a separator between texts (windows that
    span one are dropped), so the whole corpus costs n vector passes and one ``isin``."""
    index: dict[int, list[tuple[int, int]]] = {}
    for e, ids in enumerate(eval_ids):
        for pos, h in enumerate(_window_hashes(np.asarray(ids, np.int64), n).tolist()):
            index.setdefault(h, []).append((e, pos))
    sep = -1  # no token id
    flat = np.concatenate([np.append(np.asarray(ids, np.int64), sep) for ids in train_ids])
    owner = np.repeat(np.arange(len(train_ids)), [len(ids) + 1 for ids in train_ids])
    hs = _window_hashes(flat, n)
    crosses = np.convolve(flat == sep, np.ones(n, int), "valid") > 0
    hits = np.nonzero(np.isin(hs, np.fromiter(index, np.uint64, len(index))) & ~crosses)[0]
    found = set()
    for i in hits:
        for e, pos in index[int(hs[i])]:
            if flat[i:i + n].tolist() == list(eval_ids[e][pos:pos + n]):
                found.add((e, int(owner[i])))
    return sorted(found)


@pytest.fixture(scope="module")
def split_texts():
    """The evaluation prompts of the demo's benchmarks, the regeneration prompts as shipped
    (what stage 4 regenerated) and the pretraining dialogues, and the shipped tokenizer."""
    import json
    from pathlib import Path

    from d3d_jax.config import PipelineConfig, load_config
    from d3d_jax.bench.evaluation.benchmarks import load_benchmark
    from d3d_jax.pipeline.pretraining import pretrain_pairs

    cfg = load_config(PipelineConfig, ["configs/pipelines/demo.yaml"], [])
    evals = [s.turns[0] for b in cfg.eval_benchmarks
             for s in load_benchmark(b, template="plain", passage_chars=cfg.passage_chars)]
    prompts_file = Path(cfg.out_dir) / "data" / "regen_prompts.jsonl"
    regen = [json.loads(x)["messages"][0]["content"] for x in prompts_file.read_text().splitlines()]
    pretrain = [x["prompt"] + x["response"] for x in pretrain_pairs(cfg)]
    tok = AutoTokenizer.from_pretrained(str(Path(cfg.out_dir) / "tokenizer"))
    return evals, regen, pretrain, tok, cfg


def test_shipped_regeneration_prompts_are_what_a_rebuild_writes(split_texts):
    """The shipped data (and every drafter trained on it) is what ``--rebuild`` would make: the
    prompt rules in d3d_jax/demo/ cannot change without the data being regenerated."""
    from d3d_jax.pipeline.regeneration import regen_prompt_pairs

    regen, cfg = split_texts[1], split_texts[4]
    rebuilt = [pair["prompt"] for pair in regen_prompt_pairs(cfg)]
    assert len(rebuilt) == len(regen) == cfg.regen_prompts + cfg.regen_docstring_prompts
    assert [i for i, (a, b) in enumerate(zip(rebuilt, regen)) if a != b] == []


def test_no_evaluation_prompt_nor_a_64_token_window_of_one_is_in_the_training_text(split_texts):
    evals, regen, pretrain, tok, _ = split_texts
    assert len(evals) > 500 and any("def " in e for e in evals)  # HumanEval's 164 and the held-out plays
    assert sum("\"\"\"" in r or "'''" in r for r in regen) > 1000  # the docstring stubs are in
    training = regen + pretrain
    whole = "\x00".join(training)
    assert [e for e in evals if e.strip() in whole] == []
    enc = lambda texts: tok(texts, add_special_tokens=False)["input_ids"]
    eval_ids, train_ids = enc(evals), enc(training)
    assert shared_windows(eval_ids, train_ids) == []
    # The check has power: a training text quoting 70 tokens from inside an evaluation prompt is caught.
    long = next(i for i, ids in enumerate(eval_ids) if len(ids) > 100)
    planted = train_ids[:5] + [train_ids[5][:10] + eval_ids[long][20:90] + train_ids[5][10:]]
    assert (long, 5) in shared_windows(eval_ids, planted)


def test_function_stubs_have_humaneval_shape_and_skip_what_says_too_little():
    from d3d_jax.demo.prompts import function_stubs

    src = ('from typing import List\nimport os\n\n\n'
           'def mean(xs: List[float]) -> float:\n'
           '    """Return the arithmetic mean of a non-empty list of numbers.\n    >>> mean([1.0, 3.0])\n    2.0\n    """\n'
           '    return sum(xs) / len(xs)\n\n\n'
           'def short(x):\n    """Return x."""\n    return x\n\n\n'
           'class Box:\n    def area(self, scale: int = 1) -> int:\n'
           '        """Width times height of the box, multiplied by the scale factor."""\n'
           '        w = self.w\n        return w * self.h * scale\n')
    stubs = function_stubs(src)
    # The header's cut at its last line break drops `import os` (the rule the shipped data was made with).
    assert [s["prompt"] for s in stubs] == [
        'from typing import List\n\n\ndef mean(xs: List[float]) -> float:\n'
        '    """Return the arithmetic mean of a non-empty list of numbers.\n    >>> mean([1.0, 3.0])\n    2.0\n    """\n',
        'def area(self, scale: int = 1) -> int:\n    """Width times height of the box, multiplied by the scale factor."""\n']
    assert [s["response"] for s in stubs] == ["    return sum(xs) / len(xs)\n",
                                              "    w = self.w\n    return w * self.h * scale\n"]
    assert function_stubs("def broken(:\n") == []
    with pytest.raises(ValueError, match="eval split"):
        from d3d_jax.demo import docstring_prompts
        docstring_prompts(splits=("eval",))
