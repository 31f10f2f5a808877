"""The target's own log-probabilities of a prompt's tokens (``echo`` with ``logprobs``).

One causal forward of the target over the prompt, padded to a power-of-two bucket (padding
after the prompt changes nothing before it): the log-probability of token ``i`` is
``log_softmax(logits[i - 1])[token i]``, raw (no sampling transform: the prompt was not sampled).
The first token has none (OpenAI sends ``null``).  Pure and thread-safe: the HTTP layer calls it
from its worker threads while the scheduler's thread decodes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from d3d_jax.decoding.decoder_config import prompt_bucket
from d3d_jax.decoding.verify import MAX_TOP_LOGPROBS


class PromptScorer:
    def __init__(self, target, max_len: int, programs=None, params=None):
        """``programs``: the decoder's :class:`~d3d_jax.decoding.programs.ProgramStore` (its salt
        holds the target's config and graph), so a restart reads the scoring programs too.
        ``params``: the target's parameters as the decoder placed them (:func:`decoder_params`),
        so scoring reads the decoder's copy, on its slice, and keeps no second one."""
        self.graphdef, own = nnx.split(target)
        self.params = own if params is None else params
        self.max_len = int(max_len)
        self.top = min(MAX_TOP_LOGPROBS, target.config.vocab_size)
        self._score = (programs.jit(self._score_fn, name="PromptScorer._score_fn")
                       if programs is not None else jax.jit(self._score_fn))

    def _score_fn(self, params, tokens):
        model = nnx.merge(self.graphdef, params)
        lp = jax.nn.log_softmax(model(tokens).astype(jnp.float32), axis=-1)  # [1, P, V]
        chosen = jnp.take_along_axis(lp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
        top_lp, top_ids = jax.lax.top_k(lp[:, :-1], self.top)
        return chosen[0], top_ids[0], top_lp[0]

    def warm(self, length: int) -> None:
        self([1] * min(length, self.max_len), 0)

    def __call__(self, ids, top: int) -> list[tuple[float | None, list | None]]:
        """Per prompt token: (log-prob, its ``top`` most likely alternatives), the first (None, None)."""
        n = len(ids)
        tokens = np.zeros((1, prompt_bucket(n, max(self.max_len, n))), np.int32)
        tokens[0, :n] = ids
        chosen, top_ids, top_lp = jax.device_get(self._score(self.params, tokens))
        top = min(int(top), self.top)
        return [(None, None)] + [(float(chosen[i]), [(int(t), float(v)) for t, v in
                                                      zip(top_ids[i, :top], top_lp[i, :top])])
                                 for i in range(n - 1)]


def decoder_params(decoder, target):
    """The decoder's placed target parameters in ``target``'s state structure."""
    return jax.tree.unflatten(jax.tree.structure(nnx.state(target)), decoder.param_leaves()[0])
