"""A target, drafter and tokenizer that do not belong together are refused in one line
(d3d_jax/io/pairing.py), before a decoder is built; ones that do pass and give the mask id."""
from types import SimpleNamespace

import pytest

from d3d_jax.errors import ModelFileError
from d3d_jax.io.pairing import check_pairing, tokenizer_mask_id


class Tok:
    def __init__(self, vocab: dict):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)

    def __len__(self):
        return len(self.vocab)


TOK = Tok({"<|endoftext|>": 0, "<|im_end|>": 1, "<|MASK|>": 2, "a": 3})
TARGET = SimpleNamespace(vocab_size=8)


def drafter(mask=2, vocab=8):
    return SimpleNamespace(vocab_size=vocab, mask_token_id=mask)


def test_a_matching_pair_passes_and_gives_the_drafters_mask_id():
    assert tokenizer_mask_id(TOK) == 2 and tokenizer_mask_id(Tok({"a": 0})) is None
    assert check_pairing(TOK, TARGET, drafter(), eos_ids=(1,)) == 2
    assert check_pairing(Tok({"a": 0}), TARGET, drafter(mask=7)) == 7  # no <|MASK|> to compare with
    assert check_pairing(TOK, TARGET, None, eos_ids=(0, 1)) is None  # plain decoding: no drafter


@pytest.mark.parametrize("kw, fragment", [
    (dict(drafter_config=drafter(mask=5)), "--drafter's config.json mask_token_id is 5 but the tokenizer's <|MASK|> is id 2"),
    (dict(drafter_config=drafter(), mask_token_id=6), "--mask-token-id is 6 but the tokenizer's <|MASK|> is id 2"),
    (dict(drafter_config=drafter(vocab=16)), "--drafter: vocab_size 16 differs from the target's 8"),
    (dict(eos_ids=(99999,)), "EOS id 99999 is outside the target's vocabulary [0, 8)"),
])
def test_a_mismatch_is_one_line_naming_both_sides(kw, fragment):
    with pytest.raises(ModelFileError) as e:
        check_pairing(TOK, TARGET, **kw)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused():
    with pytest.raises(ModelFileError, match="the tokenizer has 4 tokens but the target's vocab_size is 3"):
        check_pairing(TOK, SimpleNamespace(vocab_size=3))
