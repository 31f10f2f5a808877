"""A target, a drafter and a tokenizer that belong together, checked once where a command pairs
them (generate, serve, bench eval, regeneration, the pipeline), before any decoder is built.

What goes wrong silently otherwise: a drafter trained with another ``<|MASK|>`` id drafts from
tokens it never saw as masks (lossless, but τ 5.5 -> 3.5); a tokenizer whose ids run past the
embedding; an EOS id outside the vocabulary that can never end a response.
"""

from __future__ import annotations

from typing import Any

from d3d_jax.errors import ModelFileError

MASK_TOKEN = "<|MASK|>"


def tokenizer_mask_id(tokenizer: Any) -> int | None:
    """The id of ``<|MASK|>`` in the tokenizer's own vocabulary (``None`` when it has none)."""
    vocab = tokenizer.get_vocab()
    return int(vocab[MASK_TOKEN]) if MASK_TOKEN in vocab else None


def check_pairing(tokenizer: Any, target_config: Any, drafter_config: Any = None, *,
                  mask_token_id: int | None = None, eos_ids: Any = (), where: str = "--drafter") -> int | None:
    """Refuse (:class:`ModelFileError`, one line) a tokenizer, target and drafter that do not agree;
    returns the mask id the drafter drafts with (``mask_token_id``, else the drafter's config).

    * the tokenizer's ids fit both vocabularies, and target and drafter have the same one;
    * when the tokenizer has ``<|MASK|>``, the drafter's mask id is that token's id;
    * every EOS id lies inside the vocabulary.
    """
    vocab = target_config.vocab_size
    if tokenizer is not None and len(tokenizer) > vocab:
        raise ModelFileError(f"the tokenizer has {len(tokenizer)} tokens but the target's vocab_size is {vocab}: "
                             f"ids >= {vocab} would index past the embedding")
    for eos in eos_ids:
        if not 0 <= int(eos) < vocab:
            raise ModelFileError(f"EOS id {eos} is outside the target's vocabulary [0, {vocab}): it could "
                                 f"never end a response")
    if drafter_config is None:
        return mask_token_id
    if drafter_config.vocab_size != vocab:
        raise ModelFileError(f"{where}: vocab_size {drafter_config.vocab_size} differs from the target's {vocab}: "
                             f"a drafter must share the target's tokenizer")
    mask = mask_token_id if mask_token_id is not None else drafter_config.mask_token_id
    expected = tokenizer_mask_id(tokenizer) if tokenizer is not None else None
    if mask is not None and expected is not None and int(mask) != expected:
        source = "--mask-token-id" if mask_token_id is not None else f"{where}'s config.json mask_token_id"
        raise ModelFileError(f"{source} is {mask} but the tokenizer's {MASK_TOKEN} is id {expected}: the drafter "
                             f"was trained with another tokenizer (its drafts would come from tokens it never "
                             f"saw as masks); use the tokenizer it was trained with")
    return mask
