"""The embedded tokenizer: an HF directory AutoTokenizer loads, lossless on unseen text, chat template."""
import pytest
from transformers import AutoTokenizer

from d3d_jax.io import tokenizer as T


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    docs = T.load_corpus("pretrain", max_chars=300_000)
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
    held_out = T.load_corpus("eval", max_chars=20_000)
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
    for src_files in (T.shakespeare_files, T.stdlib_files):
        splits = {s: set(src_files(s)) for s in T.SPLITS}
        assert all(splits.values())
        assert not (splits["pretrain"] & splits["prompts"]) and not (splits["pretrain"] & splits["eval"])
        assert not (splits["prompts"] & splits["eval"])
    names = {T.play_name(f) for f in T.shakespeare_files("pretrain")}
    assert not names & set(T.EVAL_PLAYS + T.PROMPT_PLAYS)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="vocab_size"):
        T.train_tokenizer(["abc"], 100, "/tmp/unused_tok")
    with pytest.raises(ValueError, match="split"):
        T.load_corpus("train")
    with pytest.raises(ValueError, match="source"):
        T.load_corpus("pretrain", sources=("wikipedia",))
