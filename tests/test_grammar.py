"""Grammar masks under speculation (decoding/grammar.py): the masked verify rules emit tokens
distributed exactly as plain decoding under the same grammar.

The reference is computed in closed form: plain decoding's probability of each first two tokens,
``p(t1) p(t2 | t1)``, each the target's softmax renormalised over the tokens the grammar allows
there (the engine's own mask after ``t1``).  Against it, speculative rounds of a 3-slot block with
the masks :meth:`Matcher.block_bitmask` builds along the drafts, verified by the real rules
(point-mass and sampled drafts), over thousands of rows; a χ² test compares the two."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d3d_jax.decoding import verify as V
from d3d_jax.decoding.grammar import GrammarSpec, Vocabulary, unpack
from serve_fake import TOKENIZER

WIDTH, ROWS = 3, 2000
CHOICES = ["yes", "no", "maybe", "yellow", "noon"]


@pytest.fixture(scope="module")
def vocab():
    from d3d_jax.io.hf import load_tokenizer

    return Vocabulary(load_tokenizer(TOKENIZER)[0], 2048)


class Toy:
    """A target and a drafter whose logits depend on the prefix (seeded by it)."""

    def __init__(self, size: int):
        self.size, self.cache = size, {}

    def logits(self, prefix: tuple, who: int) -> np.ndarray:
        key = (prefix, who)
        if key not in self.cache:
            rng = np.random.default_rng(abs(hash(key)) % 2 ** 32)
            self.cache[key] = (rng.standard_normal(self.size) * (3.0 if who == 0 else 1.0)).astype(np.float32)
        return self.cache[key]


_ALLOWED: dict = {}


def allowed(vocab, spec, prefix) -> np.ndarray:
    """The engine's allowed tokens after ``prefix`` (every token once the grammar refused one)."""
    key = (spec, tuple(prefix))
    if key not in _ALLOWED:
        m = vocab.matcher(spec)
        ok = m.advance(prefix)
        _ALLOWED[key] = np.asarray(unpack(m.block_bitmask([], 1)[0], vocab.size)) if ok else np.ones(vocab.size, bool)
    return _ALLOWED[key]


def draft_probs(vocab, spec, toy, prefix, knows: float = 0.8) -> np.ndarray:
    """A drafter that knows the grammar with weight ``knows``: at 0.8 its drafts are often
    valid, so the masks of later slots are reached; at 0 nearly every draft is refused."""
    good = softmax_on(toy.logits(prefix, 1), allowed(vocab, spec, prefix))
    mix = knows * good + (1 - knows) * softmax_on(toy.logits(prefix, 1), np.ones(toy.size, bool))
    return mix.astype(np.float32)


def softmax_on(x, keep):
    x = np.where(keep, x.astype(np.float64), -np.inf)
    e = np.exp(x - x.max())
    return e / e.sum()


def reference(vocab, spec, toy) -> dict:
    p1 = softmax_on(toy.logits((), 0), allowed(vocab, spec, ()))
    out = {}
    for t1 in np.flatnonzero(p1):
        p2 = softmax_on(toy.logits((int(t1),), 0), allowed(vocab, spec, (int(t1),)))
        for t2 in np.flatnonzero(p2):
            out[(int(t1), int(t2))] = p1[t1] * p2[t2]
    return out


def spec_round(vocab, spec, toy, prefixes, rng, sampled: bool, keys, rule, proposals: bool = False):
    """One verified block per row from ``prefixes``: the emitted tokens of each.  With
    ``proposals`` a drafter blind to the grammar proposes and the host replaces each draft by
    the best allowed of its top 4 (a point mass then), as a constrained round does."""
    n = len(prefixes)
    seen: dict = {}  # rows repeat prefixes and drafts: each distinct case is built once, and one
    # matcher per prefix walks every row's block (a walk rolls back, as a request's matcher does
    # between rounds; a new matcher costs ~1 ms)

    def memo(key, build):
        if key not in seen:
            seen[key] = build(key[1])
        return seen[key]

    def at(prefix):
        return memo(("matcher", prefix), lambda p: _advanced(vocab, spec, p))

    drafts = np.zeros((n, WIDTH - 1), np.int32)
    q = np.zeros((n, WIDTH - 1, toy.size), np.float32)
    for i, pre in enumerate(prefixes):
        for k in range(WIDTH - 1):
            qk, cdf = memo(("q", pre + tuple(int(d) for d in drafts[i, :k])), lambda p: _with_cdf(
                draft_probs(vocab, spec, toy, p, 0.0 if proposals else 0.8)))
            q[i, k] = qk
            # Generator.choice(size, p=qk / qk.sum())'s own draw, its cdf built once per prefix
            drafts[i, k] = int(cdf.searchsorted(rng.random(), side="right")) if sampled else int(np.argmax(qk))
    if proposals:
        cands = np.concatenate([drafts[..., None], np.argsort(-q, axis=-1)[..., :4]], axis=-1)
        walked = [at(pre).block(drafts[i], WIDTH, cands[i]) for i, pre in enumerate(prefixes)]
        drafts = np.stack([d for d, _ in walked])
        q = np.eye(toy.size, dtype=np.float32)[drafts]
        masks = np.stack([m for _, m in walked])
    else:
        masks = np.stack([memo(("block", pre, tuple(drafts[i].tolist())),
                               lambda _, pre=pre, i=i: at(pre).block_bitmask(drafts[i], WIDTH))
                          for i, pre in enumerate(prefixes)])
    logits = np.stack([[toy.logits(pre + tuple(drafts[i, :k]), 0) for k in range(WIDTH)]
                       for i, pre in enumerate(prefixes)])
    masked = jnp.where(unpack(jnp.asarray(masks), toy.size), jnp.asarray(logits), -jnp.inf)
    anchor = jnp.asarray([len(p) for p in prefixes], jnp.int32)
    sampling = V.SamplingParams.stack([V.SamplingParams(temperature=1.0)] * n)
    accepted, nxt = rule(masked, jnp.asarray(drafts), jnp.asarray(q) if sampled else None, anchor, keys, sampling)
    accepted, nxt = np.asarray(accepted), np.asarray(nxt)
    return [tuple(int(t) for t in drafts[i, :accepted[i]]) + (int(nxt[i]),) for i in range(n)]


def _with_cdf(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    cdf = (p / p.sum()).astype(np.float64).cumsum()
    return p, cdf / cdf[-1]


def _advanced(vocab, spec, prefix):
    m = vocab.matcher(spec)
    assert m.advance(prefix)
    return m


def _block(vocab, spec, prefix, drafts):
    return _advanced(vocab, spec, prefix).block_bitmask(drafts, WIDTH)


def _walk(vocab, spec, prefix, drafts, cands):
    m = vocab.matcher(spec)
    assert m.advance(prefix)
    return m.block(drafts, WIDTH, cands)


@pytest.mark.parametrize("sampled, proposals", [(False, False), (True, False), (False, True), (True, True)])
def test_masked_speculation_samples_plain_decodings_distribution(vocab, sampled, proposals):
    from scipy.stats import chisquare

    spec = GrammarSpec("choice", tuple(CHOICES))
    toy = Toy(vocab.size)
    want = reference(vocab, spec, toy)
    rng = np.random.default_rng(1)
    keys = jax.random.wrap_key_data(jax.vmap(lambda s: jax.random.key_data(jax.random.key(s)))(
        jnp.arange(ROWS, dtype=jnp.int32) + 1000 * sampled))
    rule = V.verify_sampled if sampled else V.verify_point_mass
    out = spec_round(vocab, spec, toy, [()] * ROWS, rng, sampled, keys, rule, proposals)
    short = [i for i, o in enumerate(out) if len(o) < 2]
    if short:  # a round that kept one token: the next round, from it
        more = spec_round(vocab, spec, toy, [out[i] for i in short], rng, sampled, keys[np.asarray(short)], rule,
                          proposals)
        for i, o in zip(short, more):
            out[i] = out[i] + o
    pairs = [o[:2] for o in out]
    assert all(p in want for p in pairs), "a pair the grammar forbids"
    bins = sorted(want, key=want.get, reverse=True)
    big = [b for b in bins if want[b] * ROWS >= 5]
    observed = [sum(p == b for p in pairs) for b in big] + [sum(p not in big for p in pairs)]
    expected = [want[b] * ROWS for b in big] + [ROWS * (1 - sum(want[b] for b in big))]
    assert len(big) >= 3 and sum(o > 0 for o in observed) >= 3
    assert chisquare(observed, expected).pvalue > 1e-3, (observed, expected)


def test_a_drafter_blind_to_the_grammar_proposes_the_masked_greedy_block(vocab):
    """A drafter that ranks tokens as the target does but ignores the grammar: its raw argmax
    drafts are refused, while the walk's choice from its ranking is plain decoding's masked
    greedy block, token for token (so a greedy verify accepts all of it)."""
    spec = GrammarSpec("choice", tuple(CHOICES))
    toy = Toy(vocab.size)
    greedy, prefix = [], ()
    for _ in range(WIDTH - 1):
        t = int(np.argmax(np.where(allowed(vocab, spec, prefix), toy.logits(prefix, 0), -np.inf)))
        greedy.append(t)
        prefix += (t,)
    ranking = np.stack([np.argsort(-toy.logits(tuple(greedy[:k]), 0)) for k in range(WIDTH - 1)])
    raw = ranking[:, 0]
    assert not allowed(vocab, spec, ())[raw[0]]  # this toy's unmasked choice breaks the grammar
    drafts, masks = _walk(vocab, spec, (), raw, ranking)
    assert drafts.tolist() == greedy
    assert (masks == _block(vocab, spec, (), drafts)).all()  # the masks along the chosen drafts
    m = vocab.matcher(spec)  # slot 0's mask built beforehand (while the drafter runs): the same walk
    again, masks2 = m.block(raw, WIDTH, ranking, first=masks[0].copy())
    assert again.tolist() == greedy and (masks2 == masks).all()
