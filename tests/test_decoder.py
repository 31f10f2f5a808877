"""The long-lived decoder (continuous batching) against independent references.

References: each request decoded alone by ``engine.generate(mode="plain")`` (itself checked
against transformers in test_engine) for greedy output; the same request alone in the same
decoder for sampling (randomness is keyed by (seed, index, position), so batch company and slot
must not matter); a never-used slot for "a freed slot is reset"; counted dispatches and
device→host reads (with implicit transfers forbidden) for "async rounds never wait on the host".
One tiny config, prompts in one length bucket: each decoder compiles its few methods once.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d3d_jax.bench.generator import Generator
from d3d_jax.config import ConfigError
from d3d_jax.decoding import async_loop
from d3d_jax.decoding.decoder import (DecoderConfig, Request, RequestError, SlotError, SpecDecoder,
                                     slots_in_use)
from d3d_jax.decoding.verify import SamplingParams, verify_point_mass
from tiny_models import serve, tiny_pair

generate = Generator()

VOCAB = 32
MASK = VOCAB - 1
BLOCK = 4
CACHE = 64
SLOTS = 3
MAX_NEW = (9, 14, 6, 12, 20, 11)


@pytest.fixture(scope="module")
def setup():
    target, drafter = tiny_pair(VOCAB, MASK)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, MASK, n).tolist() for n in (1, 9, 4, 7, 2, 5)]
    # solo references: each prompt alone (batch 1), one compile for all of them
    solo = [o.token_ids for o in generate(target, prompts, max_new_tokens=max(MAX_NEW),
                                          batch_size=1, block_size=BLOCK, max_cache_len=CACHE)]
    assert all(len(set(s)) > 4 for s in solo)  # varied outputs, not a repeated token
    return dict(target=target, drafter=drafter, prompts=prompts, solo=solo, decoders={})


def _decoder(s, mode, **kw) -> SpecDecoder:
    """One decoder per (mode, options) for the whole module: compiled once."""
    key = (mode, tuple(sorted(kw.items())))
    if key not in s["decoders"]:
        # async derives C = min(12, B) = B and F = 2
        cfg = DecoderConfig(mode=mode, num_slots=SLOTS, max_cache_len=CACHE, block_size=BLOCK, **kw)
        s["decoders"][key] = SpecDecoder(s["target"], None if mode == "plain" else s["drafter"], cfg)
    dec = s["decoders"][key]
    dec.free(range(SLOTS))
    return dec


def _drive(dec, tokens: dict) -> dict:
    """Step until every slot of ``tokens`` finished; their tokens."""
    done: set = set()
    while len(done) < len(tokens):
        for slot, out in dec.step().items():
            tokens[slot] += out.token_ids
            if out.finished:
                done.add(slot)
    return tokens


@pytest.mark.parametrize("mode", ["plain", "sync", "async"])
def test_continuous_batching_equals_solo_greedy(setup, mode):
    """Requests join at different rounds, one is cancelled mid-way and its slot reused, more
    requests than slots queue: every completed request gets exactly its solo greedy output."""
    s = setup
    dec = _decoder(s, mode)
    reqs = [Request(p, max_new_tokens=n, index=i) for i, (p, n) in enumerate(zip(s["prompts"], MAX_NEW))]
    tokens, reasons = serve(dec, reqs, schedule=[0, 0, 1, 2, 2, 5], cancel={1: 3})
    assert reasons[1] == "cancelled"
    assert 0 < len(tokens[1]) < MAX_NEW[1] and tokens[1] == s["solo"][1][: len(tokens[1])]
    for i in (0, 2, 3, 4, 5):
        assert reasons[i] == "length"
        assert tokens[i] == s["solo"][i][: MAX_NEW[i]], (mode, i)
    assert slots_in_use(dec) == []


def test_the_decoder_reads_the_callers_weights_in_place(setup):
    """No copy of a caller's weights: a stacked model's arrays (training's layout) and a per-layer
    model's are the very arrays the decoder binds, drafter's too; either layout decodes the solo
    greedy tokens."""
    from flax import nnx

    from d3d_jax.model.qwen3 import unstacked

    s = setup
    own = lambda m: {id(x) for x in jax.tree.leaves(nnx.state(m))}  # noqa: E731
    dec = _decoder(s, "sync")
    assert {id(x) for x in dec._params[0]} == own(s["target"])
    assert {id(x) for x in dec._params[1]} == own(s["drafter"])
    loose = unstacked(s["target"])
    cfg = DecoderConfig(mode="plain", num_slots=SLOTS, max_cache_len=CACHE, block_size=BLOCK)
    dec = SpecDecoder(loose, None, cfg)
    assert {id(x) for x in dec._params[0]} == own(loose)
    reqs = [Request(p, max_new_tokens=n, index=i) for i, (p, n) in enumerate(zip(s["prompts"][:2], MAX_NEW))]
    tokens, _ = serve(dec, reqs, schedule=[0, 0])
    assert [tokens[i] for i in (0, 1)] == [s["solo"][i][: MAX_NEW[i]] for i in (0, 1)]


def test_eos_and_stop_per_request(setup):
    """Each request carries its own EOS/stop ids (data, not static): cut exactly where the solo
    greedy output first hits them."""
    s = setup
    dec = _decoder(s, "sync")
    ref = s["solo"][4]
    j = next(j for j in range(2, 12) if ref[j] not in ref[:j])
    reqs = [Request(s["prompts"][4], 20, eos_token_ids=(ref[j],), index=0),
            Request(s["prompts"][4], 20, stop_token_ids=(ref[j],), index=1),
            Request(s["prompts"][4], 20, index=2)]
    tokens, reasons = serve(dec, reqs, schedule=[0, 0, 0])
    assert tokens[0] == tokens[1] == ref[: j + 1] and tokens[2] == ref[:20]
    assert (reasons[0], reasons[1], reasons[2]) == ("eos", "stop", "length")


SAMPLINGS = [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.8, top_p=0.9),
             SamplingParams(1.2, top_k=5), SamplingParams(0.7, top_p=0.8, top_k=8)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_mixed_sampling_in_one_batch_equals_each_alone(setup, mode):
    """Per-request sampling parameters are data: one batch mixing greedy, temperature, top-p
    and top-k requests gives each request the tokens it gets alone (same seed), in any slot."""
    s = setup
    dec = _decoder(s, mode)
    reqs = [Request(s["prompts"][i], 12, sampling=sp, seed=40 + i, index=i)
            for i, sp in enumerate(SAMPLINGS)]
    together, _ = serve(dec, reqs, schedule=[0, 0, 0, 1, 1])
    for i, req in enumerate(reqs):
        alone, _ = serve(dec, [req], schedule=[0])
        assert together[i] == alone[0], (mode, i)
    assert together[0] == s["solo"][0][:12]  # the greedy request is plain greedy decoding
    sampled = [together[i] != s["solo"][i][:12] for i in range(1, len(reqs))]
    assert any(sampled)  # the sampling requests really sampled
    other_seed, _ = serve(dec, [dataclasses.replace(reqs[1], seed=7)], schedule=[0])
    assert other_seed[0] != together[1]


@pytest.mark.parametrize("mode", ["plain", "sync"])
def test_an_all_greedy_batch_runs_the_loop_that_holds_no_sampling_code(setup, mode):
    """``generate``'s on-device loop for a batch of plain greedy requests is a program of its
    own (no sampling, logit processing nor logprobs in it) and decodes the solo greedy outputs;
    one request asking for logprobs takes the general loop, which decodes the same tokens."""
    from d3d_jax.decoding.engine import generate as decode

    s = setup
    dec = _decoder(s, mode)  # the module's: no other test of it runs generate's loops
    loop = f"{dec.strategy.label}/loop"
    greedy = [o.token_ids for o in decode(dec, s["prompts"][:SLOTS], max_new_tokens=8)]
    assert greedy == [r[:8] for r in s["solo"][:SLOTS]]
    assert {p for p, _ in dec.strategy.compiled} & {loop, loop + "/greedy"} == {loop + "/greedy"}
    general = decode(dec, s["prompts"][:SLOTS], max_new_tokens=8, sampling=SamplingParams(logprobs=0))
    assert [o.token_ids for o in general] == greedy
    assert loop in {p for p, _ in dec.strategy.compiled}


def _row(dec, slot):
    """Every per-row field of ``slot`` (caches up to their valid length)."""
    st = jax.device_get(dec.carry.state)
    slot = dec.placement.row_of[slot]
    n = int(st.target_cache.lengths[slot])
    d = st.drafter_state
    fields = dict(seq=st.seq[slot], anchor=st.anchor_pos[slot], plen=st.prompt_len[slot],
                  n_out=st.n_out[slot], done=st.done[slot], finish=st.finish[slot],
                  hist=st.accept_hist[slot], max_new=st.max_new[slot], stop=st.stop_ids[slot],
                  eos=st.stop_is_eos[slot], keys=st.key_data[slot],
                  sampling=np.concatenate([np.ravel(np.asarray(x)[slot]).astype(float)
                                           for x in jax.tree.leaves(st.sampling)]),
                  k=st.target_cache.k_lbskh[:, slot, :n], lengths=n,
                  dk=d.k_lbskh[:, slot, : int(d.lengths[slot])], dlen=d.lengths[slot])
    return fields


def test_freed_slot_is_reset(setup):
    """A slot that served a request, then was freed, holds exactly what a never-used slot holds
    after the same insert; and decodes the same tokens."""
    s = setup
    dec = _decoder(s, "sync")
    dec.insert(dec.prefill(Request(s["prompts"][1], 14, SamplingParams(1.0), (5,), seed=3)), 0)
    for _ in range(3):
        dec.step()
    dec.free(0)
    dec._drain()  # the round queued ahead ran too: its writes must not survive either
    new = Request(s["prompts"][3], 8, index=3)
    dec.insert(dec.prefill(new), 0)  # reused
    dec.insert(dec.prefill(new), 2)  # never used
    dec._flush()  # admitted (the next round would do it first)
    a, b = _row(dec, 0), _row(dec, 2)
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)
    tokens = _drive(dec, {0: [], 2: []})
    assert tokens[0] == tokens[2] == s["solo"][3][:8]


def test_insert_into_busy_slot_is_a_clear_error(setup):
    s = setup
    dec = _decoder(s, "plain")
    dec.insert(dec.prefill(Request(s["prompts"][0], 5)), 1)
    prefix = dec.prefill(Request(s["prompts"][2], 5, index=2))
    with pytest.raises(SlotError, match="slot 1 is busy"):
        dec.insert(prefix, 1)
    with pytest.raises(SlotError, match="out of range"):
        dec.insert(prefix, SLOTS)
    dec.insert(prefix, 0)  # the decoder goes on serving
    tokens = _drive(dec, {0: [], 1: []})
    assert tokens == {0: s["solo"][2][:5], 1: s["solo"][0][:5]}


@pytest.mark.parametrize("kw,key", [
    (dict(mode="beam"), "decoder.mode"), (dict(num_slots=0), "decoder.num_slots"),
    (dict(block_size=1), "decoder.block_size"),
    (dict(mode="async", branch_positions=BLOCK + 1), "decoder.branch_positions"),
    (dict(mode="async", branch_fanout=0), "decoder.branch_fanout"),
    (dict(mode="async", sample_drafts=True), "decoder.sample_drafts"),
    (dict(target_devices=0), "decoder.target_devices"),
    (dict(max_cache_len=BLOCK), "decoder.max_cache_len"),
    (dict(eos_token_ids=(-1,)), "decoder.eos_token_ids"),
    (dict(mode="async", acceptance_override=object()), "decoder.acceptance_override"),
])
def test_config_errors_name_the_key(kw, key):
    # refused when built, or (what needs the mode a config leaves to derive) when resolved, as a
    # decoder resolves what it is handed: no invalid config reaches a decoder
    with pytest.raises(ConfigError, match=key):
        DecoderConfig(**{**dict(num_slots=2, max_cache_len=CACHE, block_size=BLOCK), **kw}).resolved()


def test_request_errors_name_the_problem(setup):
    s = setup
    dec = _decoder(s, "plain")
    cases = [(Request([], 5), "prompt is empty"), (Request([VOCAB], 5), "outside the vocabulary"),
             (Request("abc", 5), "is a string"), (Request([1], 0), "max_new_tokens must be >= 1"),
             (Request([1] * 40, 30), "exceeds max_cache_len 64"),
             (Request([1], 5, SamplingParams(-1.0)), "temperature must be >= 0"),
             (Request([1], 5, SamplingParams(1.0, top_p=0.0)), "top_p must be in"),
             (Request([1], 5, stop_token_ids=(VOCAB + 3,)), "stop_token_ids has id"),
             (Request([1], 5, seed=-1), "seed and index")]
    for req, msg in cases:
        with pytest.raises(RequestError, match=msg):
            dec.validate_request(req)
        with pytest.raises(ValueError, match=msg):  # prefill checks first, before any work
            dec.prefill(req)
    with pytest.raises(ConfigError, match="needs a drafter"):
        SpecDecoder(s["target"], None, DecoderConfig(mode="sync", num_slots=1, max_cache_len=CACHE))


# --------------------------------------------------------------------------------------
# acceptance_override: the benchmark-only hook (a stand-in for d3d_jax.bench.simulate)
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FullBlocks:
    """Every round accepts every draft, and (async) every outcome hits the all-accept branch."""

    benchmark_only = True

    def accept(self, accepted, next_token, anchor_pos, row_keys, width):
        return jnp.full_like(accepted, width - 1), next_token

    def hit(self, hit, branch, accepted, next_token, anchor_pos, row_keys, layout):
        return jnp.ones_like(hit), jnp.full_like(branch, layout.all_accept_index)


@dataclasses.dataclass(frozen=True)
class Unchanged:
    """Hands back what the real rule and the real branch match decided."""

    benchmark_only = True

    def accept(self, accepted, next_token, anchor_pos, row_keys, width):
        return accepted, next_token

    def hit(self, hit, branch, accepted, next_token, anchor_pos, row_keys, layout):
        return hit, branch


def _run(dec, reqs):
    metrics = {}
    tokens, _ = serve(dec, reqs, schedule=[0] * len(reqs), metrics=metrics)
    return [dict(metrics[i], token_ids=tokens[i]) for i in range(len(reqs))]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_acceptance_override_sets_tau(setup, mode):
    """Forcing full acceptance gives τ = B exactly (and, async, a hit every round); handing the
    real decision back changes nothing: the hook sits after the real rule and branch match."""
    s = setup
    reqs = [Request(s["prompts"][i], 13, index=i) for i in range(SLOTS)]
    forced = _run(_decoder(s, mode, acceptance_override=FullBlocks()), reqs)
    rounds = -(-13 // BLOCK)  # every round commits a whole block
    for r in forced:
        assert r["n_out"] == 13 and r["accept_hist"] == [0] * (BLOCK - 1) + [rounds]
        assert r["tau"] == BLOCK
        if mode == "async":  # judged: every round but the last (no next block is needed)
            assert r["hits"] == rounds - 1 and r["misses"] == 0
    real = _run(_decoder(s, mode), reqs)
    same = _run(_decoder(s, mode, acceptance_override=Unchanged()), reqs)
    assert any(r["tau"] < BLOCK for r in real)
    for a, b, i in zip(real, same, range(SLOTS)):
        assert a["token_ids"] == b["token_ids"] == s["solo"][i][:13]
        assert a["accept_hist"] == b["accept_hist"] and a["hits"] == b["hits"]


# --------------------------------------------------------------------------------------
# Async rounds never wait on the host
# --------------------------------------------------------------------------------------
def test_async_rounds_only_dispatch(setup, monkeypatch):
    """While rounds run, the host copies nothing from the devices but the done flags (every
    array materialized on the host is logged: an implicit read such as ``int(x)`` would show),
    reads them every few rounds (STOP_CHECK_EVERY apart until the rows near their end), each
    read only after the next round's verify and branch pack were dispatched, and dispatches
    exactly three computations per round whatever the hits and misses (the sync draft runs on
    the device)."""
    from jax._src.array import ArrayImpl

    s = setup
    dec = _decoder(s, "async")
    for i in range(SLOTS):
        dec.insert(dec.prefill(Request(s["prompts"][i], 20, index=i)), i)
    log = []

    def counting(name, fn):
        def wrapped(*args, **kw):
            out = fn(*args, **kw)
            log.append((name, out[1] if name == "verify" else None))
            return out
        return wrapped

    strategy = dec.strategy
    for name, attr in (("verify", "_target_step"), ("packed", "_packed"), ("select", "_select")):
        monkeypatch.setattr(strategy, attr, counting(name, getattr(strategy, attr)))
    host_value = ArrayImpl._value

    def logged(self):  # every device→host copy of an array ends here
        if self._npy_value is None:
            log.append(("read", self))
        return host_value.fget(self)

    monkeypatch.setattr(ArrayImpl, "_value", property(logged))
    timings = dec.run_until_done()
    monkeypatch.setattr(ArrayImpl, "_value", host_value)
    rounds = timings["async_rounds"]
    names = [n for n, _ in log]
    assert [n for n in names if n != "read"] == ["verify", "packed", "select"] * rounds
    decisions = [x for n, x in log if n == "verify"]
    reads = [(i, next((k for k, d in enumerate(decisions) if d is x), None))
             for i, (n, x) in enumerate(log) if n == "read"]
    checks = [(i, k) for i, k in reads if k is not None]
    assert len(reads) == len(checks)  # nothing but the done checks
    read_rounds = [k for _, k in checks]
    assert read_rounds[:2] == [0, async_loop.STOP_CHECK_EVERY]  # far from the end: every 4th
    assert 1 <= len(checks) <= rounds // 2, (read_rounds, rounds)
    for i, k in checks:  # round k's flags are read only once round k+1 is queued behind it
        assert names[:i].count("verify") >= k + 2 and names[:i].count("packed") >= k + 2
    results = dec.results(range(SLOTS))
    assert [r["token_ids"] for r in results] == [s["solo"][i][:20] for i in range(SLOTS)]
    assert sum(r["misses"] for r in results) > 0  # misses happened, yet no extra dispatch


def test_the_decoder_and_the_serving_fake_keep_the_contract(setup):
    """SpecDecoder is the contract's members and ``run_until_done`` (its own loop) and nothing
    more public; the serving tests' fake has every member the scheduler and server use."""
    import inspect

    from d3d_jax.decoding.contract import Decoder
    from serve_fake import FakeConfig, FakeDecoder

    dec = _decoder(setup, "sync")
    assert isinstance(dec, Decoder) and isinstance(FakeDecoder(FakeConfig()), Decoder)
    contract = {n for n in vars(Decoder) if not n.startswith("_")} | set(Decoder.__annotations__)
    public = {n for n, _ in inspect.getmembers(SpecDecoder) if not n.startswith("_")}
    assert public == contract - {"config", "vocab_size", "programs"} | {"run_until_done"}
    assert len(public) <= 15  # requests and rounds (10), KV pages and where the weights are (5)


def test_sync_prefill_rounds_run_no_acceptance_rule(setup):
    """A round in which every running row caches prompt tokens skips the LM head and the rule:
    the rule (counted on the device by a callback) runs once per round that emits tokens, the
    tokens stay the solo greedy ones.  Was: every prefill round ran the head and the rule."""
    s = setup
    calls = []

    def counted(*args):
        jax.debug.callback(lambda: calls.append(1))
        return verify_point_mass(*args)

    dec = _decoder(s, "sync", acceptance_rule=counted)
    metrics = {}
    # 9 prompt tokens: 8 to cache, two prefill rounds of width 4, then rounds that emit
    tokens, _ = serve(dec, [Request(s["prompts"][1], max_new_tokens=10)], [0], metrics=metrics)
    jax.effects_barrier()
    assert tokens[0] == s["solo"][1][:10]
    assert len(calls) == metrics[0]["rounds"] > 0


def test_sync_prefills_short_prompts_by_rounds_and_long_ones_at_once(setup):
    """A sync decoder feeds a short prompt's tokens through its first rounds and prefills a prompt
    longer than its round-prefill limit in one forward; side by side in one batch, each gives
    its solo greedy tokens."""
    s = setup
    dec = _decoder(s, "sync")
    limit = dec.strategy.round_prefill_blocks * BLOCK
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, MASK, limit + 7).tolist(), s["prompts"][1]]
    solo = [o.token_ids for o in generate(s["target"], prompts, max_new_tokens=10, batch_size=1,
                                          block_size=BLOCK, max_cache_len=CACHE)]
    reqs = [Request(p, max_new_tokens=10, index=i) for i, p in enumerate(prompts)]
    tokens, _ = serve(dec, reqs, schedule=[0, 0])
    assert [tokens[0], tokens[1]] == solo
