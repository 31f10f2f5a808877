"""The program store (``decoding/programs.py``): a restart reads the decoder's compiled programs
instead of tracing, lowering and compiling them, and decodes exactly as before.

Each start is its own process (what a server restart is).  References: every request decoded
alone by plain decoding (``bench.generator``, checked against transformers in test_engine);
greedy speculative decoding must equal it token for token whatever the store did.  The store's
own counts say what each start did (programs read, compiled, written, found damaged).
A server's restart on its store (``infer/serve.py``: the first request compiles nothing, auto's
round times read back) is test_serve_e2e's load test, which serves its load on such a restart.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from d3d_jax.bench.generator import Generator
from tiny_models import tiny_pair

ROOT = Path(__file__).resolve().parent.parent
VOCAB, MASK, BLOCK, CACHE = 32, 31, 4, 64
PROMPTS = [[3, 5, 7], [11, 2, 9, 4, 1, 8, 6], [9, 9, 1, 2, 3]]
MAX_NEW = [12, 10, 8]

# one start: a tiny decoder per mode driven like a server (requests arrive at rounds 0, 0 and 2 and
# queue for a free slot), its tokens and what its program store did
START = r"""
import json, logging, sys
logging.basicConfig(level=logging.ERROR)
from tiny_models import serve, tiny_pair
from d3d_jax.decoding.decoder import DecoderConfig, Request, SpecDecoder
modes, directory, slots = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3])
prompts, max_new = json.loads(sys.argv[4]), json.loads(sys.argv[5])
target, drafter = tiny_pair(%(vocab)d, %(mask)d)
out = {}
for mode in modes:
    cfg = DecoderConfig(mode=mode, num_slots=slots, max_cache_len=%(cache)d, block_size=%(block)d)
    dec = SpecDecoder(target, drafter, cfg, program_dir=directory)
    tokens, _ = serve(dec, [Request(p, n) for p, n in zip(prompts, max_new)], [0, 0, 2])
    out[mode] = dict(tokens=[tokens[i] for i in range(len(prompts))], counts=dec.programs.counts,
                     dir=str(dec.programs.dir))
print(json.dumps(out))
""" % dict(vocab=VOCAB, mask=MASK, cache=CACHE, block=BLOCK)


def _start(modes: str, directory: Path, slots: int = 1, jax_cache: Path | None = None) -> dict:
    """One process: ``modes`` (comma-separated), each its own decoder on one program directory.
    One slot (one window width, the later requests queue for it): what a restart reads or compiles
    does not depend on the widths, and each width added its round programs to every cold start."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    if jax_cache is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(jax_cache)
    out = subprocess.run([sys.executable, "-c", START, modes, str(directory), str(slots),
                          json.dumps(PROMPTS), json.dumps(MAX_NEW)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def solo():
    target, _ = tiny_pair(VOCAB, MASK)
    outs = Generator()(target, PROMPTS, max_new_tokens=max(MAX_NEW), batch_size=1, block_size=BLOCK,
                       max_cache_len=CACHE)
    ref = [o.token_ids[:n] for o, n in zip(outs, MAX_NEW)]
    assert all(len(set(r)) > 3 for r in ref)  # varied outputs: an ordering bug would show
    return ref


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.xprog"))


@pytest.mark.slow
def test_restart_reads_every_program_and_damage_is_compiled_again(solo, tmp_path):
    """Three starts of a sync and an async decoder on one program directory: the cold one
    compiles and stores every program; then, with one sync entry torn and another removed, a
    restart reads the others (async's all), and the next start reads every one again."""
    store, jax_cache = tmp_path / "programs", tmp_path / "xla"
    cold = _start("sync,async", store, jax_cache=jax_cache)
    sync, asyn = cold["sync"], cold["async"]
    assert sync["tokens"] == solo and asyn["tokens"] == solo
    n, m = sync["counts"]["stored"], asyn["counts"]["stored"]
    # at least the state, an admission and a round: one slot
    assert sync["counts"]["compiled"] >= 3 and n == sync["counts"]["compiled"] and sync["counts"]["loaded"] == 0
    assert m == asyn["counts"]["compiled"] >= 6 and asyn["dir"] != sync["dir"], asyn["counts"]
    entries = _entries(Path(sync["dir"]))
    assert len(entries) == n and len(_entries(store)) == n + m

    biggest = max(entries, key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])  # a torn write
    # an entry removed while JAX's own cache still holds it: JAX answers its compile, and an
    # executable read back from JAX's cache is never serialized (XLA:CPU would lose functions of
    # it), so it is compiled afresh and stored, as the torn one is
    min((p for p in entries if p != biggest), key=lambda p: p.stat().st_size).unlink()
    torn = _start("sync,async", store, jax_cache=jax_cache)  # a restart: the rest read, none traced
    assert torn["sync"]["tokens"] == solo and torn["async"]["tokens"] == solo
    assert torn["sync"]["counts"] == dict(loaded=n - 2, compiled=2, stored=2, cache_answered=2, damaged=1)
    assert torn["async"]["counts"] == dict(loaded=m, compiled=0, stored=0, cache_answered=0, damaged=0)
    again = _start("sync", store, jax_cache=jax_cache)  # the two compiled afresh are read too
    assert again["sync"]["tokens"] == solo
    assert again["sync"]["counts"] == dict(loaded=n, compiled=0, stored=0, cache_answered=0, damaged=0)


def test_a_decoder_that_cannot_be_keyed_keeps_nothing(tmp_path):
    """An acceptance override is a Python object the programs close over: no stable key, so no
    store (plain ``jax.jit``), rather than a program read back for another override."""
    from d3d_jax.decoding.decoder import DecoderConfig, SpecDecoder

    target, drafter = tiny_pair(VOCAB, MASK)

    class Always:
        benchmark_only = True

        def accept(self, accepted, *args):
            return accepted

    cfg = DecoderConfig(mode="sync", num_slots=1, max_cache_len=CACHE, block_size=BLOCK,
                        acceptance_override=Always())
    assert not SpecDecoder(target, drafter, cfg, program_dir=tmp_path).programs.enabled
    plain = DecoderConfig(mode="sync", num_slots=1, max_cache_len=CACHE, block_size=BLOCK)
    keyed = SpecDecoder(target, drafter, plain, program_dir=tmp_path).programs
    assert keyed.enabled and keyed.dir.parent == tmp_path
    # the key holds the decoder's whole config: other EOS ids, another store directory
    eos = SpecDecoder(target, drafter, dataclasses.replace(plain, eos_token_ids=(5,)),
                      program_dir=tmp_path).programs
    assert eos.dir != keyed.dir
    slots = SpecDecoder(target, drafter, dataclasses.replace(plain, num_slots=2), program_dir=tmp_path).programs
    assert slots.dir not in (eos.dir, keyed.dir)
    # ... and so does the same decoder in another process (the key is text, not object ids)
    again = SpecDecoder(target, drafter, plain, program_dir=tmp_path).programs
    assert again.dir == keyed.dir


def test_programs_by_argument_types_and_a_second_store_reads_them(tmp_path):
    """One program called with two shapes under the same tree (the scorer's prompt buckets): each
    shape its own executable, right values each time (a numpy reference); a second store on the
    same directory reads both and compiles nothing."""
    import jax.numpy as jnp

    from d3d_jax.decoding.programs import ProgramStore

    def f(x, y, start, *, rows):
        return {"a": x[:rows] * 2 + start, "b": y.sum()}

    xs = [np.arange(8.0, dtype=np.float32), np.arange(4.0, dtype=np.float32) + 10]
    for store in (ProgramStore(tmp_path, {"test": 1}), ProgramStore(tmp_path, {"test": 1})):
        prog = store.jit(f, name="f", static_argnames="rows")
        for x in (xs[0], xs[1], xs[0]):
            out = prog(jnp.asarray(x), jnp.ones((3,)), 3, rows=2)
            np.testing.assert_array_equal(np.asarray(out["a"]), x[:2] * 2 + 3)
            assert float(out["b"]) == 3.0
    assert store.counts == dict(loaded=2, compiled=0, stored=0, cache_answered=0, damaged=0)
    other = ProgramStore(tmp_path, {"test": 2})  # another salt: its own directory, nothing read
    assert other.dir != store.dir and other.stored() == 0


def test_only_the_most_recently_used_salts_are_kept(tmp_path):
    from d3d_jax.decoding.programs import KEEP_SALTS, ProgramStore

    for i in range(KEEP_SALTS + 3):  # older salts, the oldest first
        old = tmp_path / f"{i:032x}"
        old.mkdir()
        os.utime(old, (1_000_000 + i, 1_000_000 + i))
    store = ProgramStore(tmp_path, {"test": 1})
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert store.dir.name in kept and len(kept) == KEEP_SALTS
    assert kept == sorted([store.dir.name] + [f"{i:032x}" for i in range(4, KEEP_SALTS + 3)])


def test_an_unusable_directory_keeps_programs_in_memory(tmp_path, caplog):
    from d3d_jax.decoding.programs import ProgramStore

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = ProgramStore(blocker / "programs", {"test": 1})
    assert not store.enabled and "not usable" in caplog.text
    assert float(store.jit(lambda x: x + 1)(1.0)) == 2.0


SORTS = r"""
import json, sys
import jax, jax.numpy as jnp
from d3d_jax.decoding.programs import ProgramStore
store = ProgramStore(sys.argv[1], {"test": "sorts"})
prog = store.jit(lambda x: (jnp.sort(x) + jnp.argsort(-x), jax.lax.top_k(x, 3)[0]), name="sorts")
a, b = prog(jnp.array([3.0, 1.0, 2.0, 5.0, 4.0]))
print(json.dumps(dict(out=[a.tolist(), b.tolist()], counts=store.counts)))
"""


def test_an_executable_from_jaxs_cache_is_compiled_afresh_before_it_is_stored(tmp_path):
    """XLA:CPU (jaxlib 0.10.2) drops functions from an executable it read back from JAX's
    persistent cache when that executable is serialized again: loaded in another process it fails
    with ``NOT_FOUND: Function wrapped_iota not found``.  Three processes: the first compiles and
    stores (JAX's cache keeps it too), the store's file is removed, the second finds the program
    only in JAX's cache, and the third must still read a working program from the store."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"))

    def run():
        out = subprocess.run([sys.executable, "-c", SORTS, str(tmp_path / "programs")], capture_output=True,
                             text=True, env=env, cwd=ROOT, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    want = [[4.0, 6.0, 3.0, 6.0, 6.0], [5.0, 4.0, 3.0]]  # sort + argsort(-x), top 3, by hand
    first = run()
    assert first["out"] == want and first["counts"]["stored"] == 1
    for p in _entries(tmp_path / "programs"):
        p.unlink()
    second = run()
    assert second["out"] == want
    assert second["counts"]["cache_answered"] == 1 and second["counts"]["stored"] == 1
    third = run()
    assert third["out"] == want and third["counts"]["loaded"] == 1


def test_device_ids_keep_the_executables_device_order():
    """The store records a program's devices through JAX's public ``runtime_executable()``; a
    JAX upgrade that reorders or drops ``local_devices()`` would load programs on the wrong
    devices, so the order of a non-sorted mesh is pinned here."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from d3d_jax.decoding.programs import device_ids

    devs = jax.devices()
    assert len(devs) >= 4, "conftest asks for 8 CPU devices"
    order = [devs[i] for i in (3, 1, 2, 0)]
    x = jax.device_put(jnp.ones(8), NamedSharding(Mesh(np.array(order), ("x",)), PartitionSpec("x")))
    compiled = jax.jit(lambda v: v * 2).lower(x).compile()
    assert device_ids(compiled) == [d.id for d in order]


@pytest.mark.parametrize("mode", ["sync", "auto"])
def test_a_warm_up_compiles_every_program_ahead_off_the_calling_thread_then_runs_them(solo, tmp_path,
                                                                                      monkeypatch, mode):
    """``ProgramStore.ahead``: the warm-up's programs are compiled by worker threads with nothing
    run, each output a type; the warm-up's run then compiles nothing, and decoding after it
    equals plain decoding of each request alone."""
    import threading

    from tiny_models import serve

    from d3d_jax.decoding import programs as P
    from d3d_jax.decoding.decoder import DecoderConfig, Request, SpecDecoder

    threads, ahead = set(), []
    real_compile, real_ahead = P.Program._compile_lowered, P.ProgramStore.ahead

    def compile_lowered(self, *a):
        threads.add(threading.current_thread().name)
        return real_compile(self, *a)

    def counted_ahead(self, warm, workers=None):
        before = self.counts["compiled"]  # the decoder's state was made before the warm-up
        n = real_ahead(self, warm, workers=2)
        ahead.append((n, before, self.counts["compiled"]))
        return n

    monkeypatch.setattr(P.Program, "_compile_lowered", compile_lowered)
    monkeypatch.setattr(P.ProgramStore, "ahead", counted_ahead)
    target, drafter = tiny_pair(VOCAB, MASK)
    # two slots: widths 1 and 2, each compiled ahead like any other (4 slots added a width and
    # its rounds to compile, and nothing else)
    cfg = DecoderConfig(mode=mode, num_slots=2, max_cache_len=CACHE, block_size=BLOCK)
    dec = SpecDecoder(target, drafter, cfg, program_dir=tmp_path)
    dec.warm_up()
    (n, before, after), = ahead
    # every prompt bucket's admission, every width's round (auto: of every geometry), row ops
    rounds = len(cfg.buckets) * (len(dec.strategy.geometry) if mode == "auto" else 1)
    assert n == after - before == len(cfg.prompt_buckets) + rounds + 1, (n, before, after)
    assert dec.programs.counts["compiled"] == after  # the run compiled none
    assert threads and all(t.startswith("d3d-compile") for t in threads), threads
    assert dec.programs.stored() == after  # each kept on disk too
    tokens, _ = serve(dec, [Request(p, k) for p, k in zip(PROMPTS, MAX_NEW)], [0, 0, 2])
    assert [tokens[i] for i in range(len(PROMPTS))] == solo


@pytest.mark.parametrize("page", [0, 16], ids=["dense", "paged"])
def test_a_warm_up_admits_only_the_widths_of_prompts_up_to_its_cap(page):
    """``prompt_cap``: admission (a paged cache: its prefill chunks) at the widths a prompt of up
    to that many tokens is padded to, and no other; none given, every width.  The server passes
    the longest prompt it warms (before ``READY`` the first bucket's), so a longer prompt's program
    is the background's, or compiled when one comes, not compiled before the first client."""
    from d3d_jax.decoding import engine

    target, _ = tiny_pair(VOCAB, MASK)
    dec = engine.make_decoder(target, mode="plain", num_slots=2, max_cache_len=CACHE,
                              kv_page_size=page or None)
    st, seen = dec.strategy, []
    admit, piece = st.admit, st.prefill_piece
    st.admit = lambda carry, params, rows, *a: seen.append(rows.prompt.shape[1]) or admit(carry, params, rows, *a)
    st.prefill_piece = lambda carry, params, rows, tokens, *a: (seen.append(tokens.shape[1])
                                                                or piece(carry, params, rows, tokens, *a))
    dec.warm_up(prompt_cap=17)
    assert sorted(set(seen)) == [16, 32]  # 17 tokens pad to 32; 64 is left
    seen.clear()
    dec.warm_up()
    assert sorted(set(seen)) == [16, 32, 64]
    assert engine.generate(dec, [[1] * 40], max_new_tokens=3)[0].token_ids  # 40 tokens: the 64-wide program


def test_loading_and_a_sync_decoders_first_generate_compile_only_the_decoders_programs(tmp_path):
    """Two models read from disk and a sync decoder's first ``generate``, in a process that has
    compiled nothing (JAX's caches cleared and its disk cache off for the test): every program
    XLA compiles is the decoder's own (state, admission, on-device loop, results) or JAX's
    staging copies.  Was: loading each model compiled a weight-check program as well."""
    import jax

    from d3d_jax.decoding import engine
    from d3d_jax.io.checkpoint import load_decoding_model
    from d3d_jax.io.hf import save_qwen3

    for name, model in zip(("target", "drafter"), tiny_pair(VOCAB, MASK)):
        save_qwen3(model, tmp_path / name)
    compiled = []

    def on_event(event, duration, fun_name=None, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(re.sub(r"^jit\((.*)\)$", r"\1", str(fun_name)))

    was, dump = jax.config.jax_enable_compilation_cache, jax.config._read("jax_dump_ir_to")
    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_dump_ir_to", str(tmp_path / "ir"))  # the modules JAX compiles
    jax.clear_caches()
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        target, drafter = (load_decoding_model(tmp_path / n) for n in ("target", "drafter"))
        dec = engine.make_decoder(target, drafter, mode="sync", max_cache_len=CACHE, block_size=BLOCK,
                                  mask_token_id=MASK)
        out = engine.generate(dec, PROMPTS[:1], max_new_tokens=MAX_NEW[0])
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
        jax.config.update("jax_enable_compilation_cache", was)
        jax.config.update("jax_dump_ir_to", dump)
    assert len(out[0].token_ids) == MAX_NEW[0]
    own = sorted(n for n in compiled if n != "stage")
    assert own == sorted(["init_state", "_admit_fn", "_loop_fn", "<lambda>"]), compiled
    assert len(compiled) <= 30
    # The layers are compiled once, in the loop: the admission holds no matmul (a sync row's
    # prompt is prefilled by the round's own forward).  Was: the admission compiled both models'
    # layers again at the prompt's width, half of a sync decoder's first compile.
    assert _matmuls(tmp_path / "ir", "_admit_fn") == 0
    assert _matmuls(tmp_path / "ir", "_loop_fn") > 0


def _matmuls(folder, program: str) -> int:
    """``dot_general`` ops in the one StableHLO module JAX compiled for ``program``."""
    (path,) = folder.glob(f"*jit_{program}_compile.mlir")
    return len(re.findall(r"stablehlo\.dot_general", path.read_text()))
