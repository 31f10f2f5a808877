"""Our Qwen3 against transformers' Qwen3ForCausalLM (the independent reference).

Checkpoints are written by transformers' own ``save_pretrained`` and read by our loader, so the
comparison covers the model and the HF name/layout mapping together.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Qwen3Config, Qwen3ForCausalLM

from d3d_jax.io.hf import load_qwen3
from d3d_jax.model import kv_cache as kvc
from d3d_jax.model.masks import TokenMeta, causal_meta
from d3d_jax.model.qwen3 import remove_layers

# Three tiny shapes: tied + GQA + head_dim != hidden/heads; untied, sharded into several files;
# untied multi-query with an old-layout config.json (top-level rope_theta).
CONFIGS = {
    "tied_gqa_wide_heads": dict(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                tie_word_embeddings=True, rope_theta=1e6),
    "untied_sharded": dict(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                           tie_word_embeddings=False, rope_theta=1e6),
    "untied_mqa_old_rope": dict(vocab_size=96, hidden_size=40, intermediate_size=80, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=1, head_dim=12,
                                tie_word_embeddings=False, rope_theta=1e4),
}
TOL = 1e-4


def make_hf_model(seed: int, **kw) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    theta = kw.pop("rope_theta")
    cfg = Qwen3Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": theta},
                      rms_norm_eps=1e-6, max_position_embeddings=256)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at 1; randomise them so a mis-mapped scale would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (HF model, directory written by save_pretrained)."""
    out = {}
    for i, (name, kw) in enumerate(CONFIGS.items()):
        model = make_hf_model(i, **dict(kw))
        path = tmp_path_factory.mktemp(name)
        if name == "untied_sharded":
            model.save_pretrained(path, max_shard_size="20KB")
        else:
            model.save_pretrained(path)
        if name == "untied_mqa_old_rope":  # rewrite to the pre-v5 layout: top-level rope_theta
            cfg = json.loads((path / "config.json").read_text())
            cfg.pop("rope_parameters")
            cfg["rope_theta"] = kw["rope_theta"]
            cfg["rope_scaling"] = None
            (path / "config.json").write_text(json.dumps(cfg))
        out[name] = (model, path)
    return out


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens)), use_cache=False).logits.float().numpy()


@nnx.jit
def full_forward(model, tokens):
    return model(tokens)


def test_sharded_checkpoint_really_has_several_files(checkpoints):
    _, path = checkpoints["untied_sharded"]
    assert len(list(path.glob("model-*.safetensors"))) >= 3
    assert (path / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(checkpoints, name):
    hf_model, path = checkpoints[name]
    model = load_qwen3(path)
    kw = CONFIGS[name]
    assert model.config.tie_word_embeddings == kw["tie_word_embeddings"]
    assert model.config.head_dim == kw["head_dim"]
    assert model.config.rope_theta == kw["rope_theta"]
    tokens = np.random.default_rng(0).integers(0, kw["vocab_size"], (2, 24))
    ours = np.asarray(full_forward(model, jnp.asarray(tokens)))
    ref = hf_logits(hf_model, tokens)
    assert ours.shape == ref.shape == (2, 24, kw["vocab_size"])
    assert np.abs(ref).max() > 100 * TOL  # the comparison is not vacuous
    assert np.abs(ours - ref).max() <= TOL


# ---- cached decoding --------------------------------------------------------------------
TOTAL_LENGTHS = np.array([37, 22])  # two rows of different lengths
PREFILL_LENGTHS = np.array([5, 11])
CACHE_LEN = 64


@nnx.jit
def cached_step(model, tokens, meta, cache):
    return model(tokens, meta, cache=cache)


def decode_in_chunks(model, tokens: np.ndarray, chunk: int) -> np.ndarray:
    """Prefill each row to its own length, then feed ``chunk`` tokens per row per step at the
    row's own offset (padding past each row's end); returns the logits gathered per position."""
    b, total = tokens.shape
    vocab = model.config.vocab_size
    got = np.full((b, total, vocab), np.nan, np.float32)
    cache = kvc.init_cache(model.config, b, CACHE_LEN)
    lengths = np.zeros(b, np.int64)

    def feed(width, counts):
        nonlocal cache, lengths
        pos = lengths[:, None] + np.arange(width)[None]
        valid = np.arange(width)[None] < counts[:, None]
        toks = np.where(valid, tokens[np.arange(b)[:, None], np.minimum(pos, total - 1)], 0)
        meta = causal_meta(jnp.asarray(pos), jnp.asarray(valid))
        logits, cache = cached_step(model, jnp.asarray(toks), meta, cache)
        logits = np.asarray(logits)
        for r in range(b):
            got[r, pos[r, :counts[r]]] = logits[r, :counts[r]]
        lengths = lengths + counts
        cache = cache.with_lengths(jnp.asarray(lengths))

    feed(int(PREFILL_LENGTHS.max()), PREFILL_LENGTHS)
    while (lengths < TOTAL_LENGTHS).any():
        feed(chunk, np.minimum(chunk, TOTAL_LENGTHS - lengths))
    return got


@pytest.mark.parametrize("chunk", [1, 16])
def test_cached_decoding_matches_full_forward(checkpoints, chunk):
    hf_model, path = checkpoints["tied_gqa_wide_heads"]
    model = load_qwen3(path)
    vocab = model.config.vocab_size
    tokens = np.random.default_rng(1).integers(0, vocab, (2, int(TOTAL_LENGTHS.max())))
    got = decode_in_chunks(model, tokens, chunk)
    for r, n in enumerate(TOTAL_LENGTHS):
        ref = hf_logits(hf_model, tokens[r:r + 1, :n])[0]
        assert not np.isnan(got[r, :n]).any()
        assert np.abs(got[r, :n] - ref).max() <= TOL, f"row {r}"


def test_tokens_not_kept_are_not_written_to_the_cache(checkpoints):
    _, path = checkpoints["tied_gqa_wide_heads"]
    model = load_qwen3(path)
    cache = kvc.init_cache(model.config, 1, 16)
    tokens = jnp.asarray([[3, 4, 5, 6]])
    meta = causal_meta(jnp.arange(4)[None])
    keep = jnp.asarray([[True, True, False, True]])
    _, new = nnx.jit(lambda m, t, mt, c, k: m(t, mt, cache=c, keep=k))(model, tokens, meta, cache, keep)
    written = np.abs(np.asarray(new.k_lbskh)).sum(axis=(0, 1, 3, 4))
    assert (written[[0, 1, 3]] > 0).all() and written[2] == 0 and (written[4:] == 0).all()


# ---- layer removal ------------------------------------------------------------------------
def test_remove_layers_equals_transformers_without_that_layer(checkpoints):
    hf_model, path = checkpoints["untied_mqa_old_rope"]  # 3 layers
    model = load_qwen3(path)
    pruned = remove_layers(model, [1])
    assert pruned.config.num_layers == 2 and pruned.layers.mlp.up_proj.kernel.shape[0] == 2

    reference = make_hf_model(2, **dict(CONFIGS["untied_mqa_old_rope"]))
    reference.load_state_dict(hf_model.state_dict())
    del reference.model.layers[1]
    reference.config.num_hidden_layers = 2
    tokens = np.random.default_rng(2).integers(0, 96, (2, 10))
    ours = np.asarray(full_forward(pruned, jnp.asarray(tokens)))
    assert np.abs(ours - hf_logits(reference, tokens)).max() <= TOL
    # and the original is untouched
    assert np.abs(np.asarray(full_forward(model, jnp.asarray(tokens))) - hf_logits(hf_model, tokens)).max() <= TOL
    with pytest.raises(ValueError, match="out of range"):
        remove_layers(model, [3])
    with pytest.raises(ValueError, match="every layer"):
        remove_layers(model, [0, 1, 2])


# ---- bf16 ----------------------------------------------------------------------------------
def test_bf16_params_run_close_to_float32(checkpoints):
    hf_model, path = checkpoints["untied_sharded"]
    model = load_qwen3(path, dtype="bfloat16")
    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    tokens = np.random.default_rng(3).integers(0, 128, (2, 12))
    ours = np.asarray(full_forward(model, jnp.asarray(tokens)))
    ref = hf_logits(hf_model, tokens)
    assert ours.dtype == np.float32 and np.isfinite(ours).all()
    # bf16 keeps ~3 significant digits: same ranking of the top token, small absolute error
    assert np.abs(ours - ref).max() <= 0.05 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


# ---- loading straight onto a mesh ------------------------------------------------------------
def test_load_onto_fsdp4_tensor2_mesh_matches_transformers(checkpoints):
    from d3d_jax.config import MeshConfig
    from d3d_jax.parallel.sharding import make_mesh, use_mesh

    hf_model, path = checkpoints["untied_sharded"]  # 6 heads, 3 kv heads, hidden 48
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    model = load_qwen3(path, mesh=mesh)
    attn = model.layers.self_attn  # stacked: the layer axis first, never sharded
    assert attn.q_proj.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    # 3 kv heads do not split over tensor=2: that axis stays replicated instead of failing
    assert attn.k_proj.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", None, None)
    tokens = np.random.default_rng(4).integers(0, 128, (4, 12))
    with use_mesh(mesh):
        out = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens))
    assert np.abs(np.asarray(out) - hf_logits(hf_model, tokens)).max() <= TOL
    # a mesh-sharded model exports (gathered per tensor) to a directory transformers reloads
    from d3d_jax.io.hf import save_qwen3
    out_dir = path.parent / (path.name + "_from_mesh")
    save_qwen3(model, out_dir)
    reloaded = Qwen3ForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert np.abs(hf_logits(reloaded, tokens) - hf_logits(hf_model, tokens)).max() <= 1e-6


def test_cache_span_and_logits_start_match_transformers(checkpoints):
    """Attending only to the first ``cache_span`` slots (all valid ones lie there) and computing
    logits only from ``logits_start`` on give transformers' logits; writes past the span land."""
    hf_model, path = checkpoints["tied_gqa_wide_heads"]
    model = load_qwen3(path)
    tokens = np.random.default_rng(2).integers(0, model.config.vocab_size, (2, 40))
    lengths = np.array([30, 20])  # committed per row; both <= span 32
    ref = [hf_logits(hf_model, tokens[r:r + 1])[0] for r in range(2)]

    @nnx.jit(static_argnames=("span", "start"))
    def step(model, toks, meta, cache, span, start):
        return model(toks, meta, cache=cache, cache_span=span, logits_start=start)

    cache = kvc.init_cache(model.config, 2, CACHE_LEN)
    pos = np.arange(30)[None].repeat(2, 0)
    _, cache = cached_step(model, jnp.asarray(tokens[:, :30]), causal_meta(jnp.asarray(pos),
                                                                          jnp.asarray(pos < lengths[:, None])), cache)
    cache = cache.with_lengths(jnp.asarray(lengths))
    pos = lengths[:, None] + np.arange(6)[None]  # row 0 writes positions 30..35, past the span
    logits, cache = step(model, jnp.asarray(np.take_along_axis(tokens, pos, 1)), causal_meta(jnp.asarray(pos)),
                         cache, span=32, start=2)
    assert logits.shape == (2, 4, model.config.vocab_size)
    for r in range(2):
        assert np.abs(np.asarray(logits[r]) - ref[r][pos[r, 2:]]).max() <= TOL
    # the full-span step after it reads what the short-span step wrote beyond slot 32
    cache = cache.with_lengths(jnp.asarray(lengths + 6))
    pos = (lengths + 6)[:, None] + np.arange(2)[None]
    logits, _ = step(model, jnp.asarray(np.take_along_axis(tokens, pos, 1)), causal_meta(jnp.asarray(pos)),
                     cache, span=CACHE_LEN, start=0)
    for r in range(2):
        assert np.abs(np.asarray(logits[r]) - ref[r][pos[r]]).max() <= TOL
    with pytest.raises(ValueError, match="cache_span"):
        model(jnp.asarray(tokens[:, :2]), cache=cache, cache_span=CACHE_LEN + 1)
    with pytest.raises(ValueError, match="logits_start"):
        model(jnp.asarray(tokens[:, :2]), logits_start=2)


# ---- gradients -----------------------------------------------------------------------------
def test_gradients_match_transformers(checkpoints, name="untied_mqa_old_rope"):
    """Every parameter's gradient of a next-token loss against torch autograd on the HF model
    (3 layers, full remat): the layer scan, the LM head's gradient fence (identity forward, a
    barrier in the backward) and the remat change no value."""
    import dataclasses

    from d3d_jax.io.hf import _get_path, stacked_path, tensor_mappings
    from d3d_jax.model.qwen3 import set_config

    hf_model, path = checkpoints[name]
    model = load_qwen3(path)
    model = set_config(model, dataclasses.replace(model.config, remat_policy="full"))
    tokens = np.random.default_rng(5).integers(0, CONFIGS[name]["vocab_size"], (2, 16))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        logits = nnx.merge(graphdef, p, rest)(jnp.asarray(tokens[:, :-1]))
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    grads = nnx.to_pure_dict(jax.jit(jax.grad(loss))(params))
    hf_model.zero_grad()
    logits = hf_model(torch.tensor(tokens[:, :-1]), use_cache=False).logits
    picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[:, 1:, None]))
    (-picked.mean()).backward()
    ref = dict(hf_model.named_parameters())
    for m in tensor_mappings(model.config):
        want = ref[m.hf_name].grad.numpy()
        path, layer = stacked_path(m.ours)
        got = np.asarray(_get_path(grads, path))
        got = m.to_hf(got[layer] if layer >= 0 else got)
        assert np.abs(want).max() > 1e-6, m.hf_name  # not vacuous
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), m.hf_name


# ---- the two layer layouts ------------------------------------------------------------------
def test_unstacked_layout_equals_stacked_and_transformers(checkpoints):
    """A model loaded one module per layer (what decoders run) gives transformers' logits, equal to
    the stacked model's, whole-sequence and cached; unstacking a stacked model gives the same."""
    from d3d_jax.model.qwen3 import unstacked

    hf_model, path = checkpoints["untied_mqa_old_rope"]
    stacked_model, loose = load_qwen3(path), load_qwen3(path, stacked=False)
    assert isinstance(loose.layers, nnx.List) and len(loose.layers) == 3
    tokens = np.random.default_rng(6).integers(0, 96, (2, 9))
    ref = hf_logits(hf_model, tokens)
    for m in (loose, unstacked(stacked_model)):
        assert np.abs(np.asarray(full_forward(m, jnp.asarray(tokens))) - ref).max() <= TOL
    step = nnx.jit(lambda m, t, c: m(t, causal_meta(jnp.broadcast_to(jnp.arange(9), (2, 9))), cache=c))
    cached = [step(m, jnp.asarray(tokens), kvc.init_cache(m.config, 2, 16)) for m in (stacked_model, loose)]
    np.testing.assert_allclose(np.asarray(cached[0][0]), np.asarray(cached[1][0]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(cached[0][1].k_lbskh), np.asarray(cached[1][1].k_lbskh), atol=1e-6)


def test_decoding_reads_unstacked_weights_in_place():
    """Why decoders unstack: a cached one-token step of a stacked model copies each layer's weight
    slice out of the stack before its matmul (XLA:CPU and GPU); the unstacked model's step makes
    no array of a weight's shape at all."""
    from d3d_jax.config import ModelConfig
    from d3d_jax.model.qwen3 import init_model, unstacked

    cfg = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=3, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    model = init_model(cfg, seed=0)
    meta = causal_meta(jnp.zeros((1, 1), jnp.int32))

    def weight_copies(m) -> int:
        graphdef, state = nnx.split(m)
        fn = jax.jit(lambda s, c: nnx.merge(graphdef, s)(jnp.zeros((1, 1), jnp.int32), meta, cache=c))
        text = fn.lower(state, kvc.init_cache(cfg, 1, 8)).compile().as_text()
        # an MLP weight [48, 80] made by an instruction (not a parameter of the program)
        return sum(1 for ln in text.splitlines()
                   if re.search(r"= f32\[(1,)?(48,80|80,48)\]", ln) and "parameter(" not in ln)

    assert weight_copies(model) >= 3  # the stacked scan slices them (the bar is not vacuous)
    assert weight_copies(unstacked(model)) == 0


@pytest.mark.parametrize("layered", [False, True])
def test_cached_step_writes_a_donated_cache_in_place(layered):
    """A one-token step over a donated cache writes the new rows where the cache lies: the
    compiled program (XLA:CPU) makes no copy of a whole cache array (it made two per K and V
    and step), stacked or one per layer."""
    from d3d_jax.config import ModelConfig
    from d3d_jax.model.qwen3 import init_model, unstacked

    cfg = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=3, num_heads=2,
                      num_kv_heads=2, head_dim=16)
    graphdef, state = nnx.split(unstacked(init_model(cfg, seed=0)))
    meta = causal_meta(jnp.full((1, 1), 5, jnp.int32))
    fn = jax.jit(lambda s, c: nnx.merge(graphdef, s)(jnp.zeros((1, 1), jnp.int32), meta, cache=c),
                 donate_argnums=1)
    text = fn.lower(state, kvc.init_cache(cfg, 1, 40, layered=layered)).compile().as_text()
    shape = r"1,2,40,16" if layered else r"3,1,40,2,16"
    whole = [ln for ln in text.splitlines() if re.search(r"= f32\[" + shape + r"\]\{[0-9,]*\} copy\(", ln)]
    assert not whole, whole


def test_span_buckets_add_an_attention_only_where_they_save_a_third():
    """Each cache-span bucket is one more attention per layer in a decode program: a cache within
    1.5x of a power-of-two span (176 slots) compiles one attention per layer and no switch; a
    256-slot cache still switches between 128 and 256 slots."""
    from d3d_jax.config import ModelConfig
    from d3d_jax.model.qwen3 import init_model, unstacked

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    graphdef, state = nnx.split(unstacked(init_model(cfg, seed=0)))
    tokens = jnp.zeros((1, 4), jnp.int32)

    def switches(cache_len: int) -> int:
        def step(s, cache):
            forward = lambda span, c, t: nnx.merge(graphdef, s)(  # noqa: E731
                t, causal_meta(cache.lengths[:, None] + jnp.arange(4)[None]), cache=c,
                cache_span=span, defer_cache_write=True)
            return kvc.call_with_span(forward, jnp.max(cache.lengths), cache, tokens)[0]
        text = str(jax.make_jaxpr(step)(state, kvc.init_cache(cfg, 1, cache_len, layered=False)))
        return text.count(" cond[") - text.count("platform_index")  # a platform's choice is no switch

    assert switches(176) == 0
    assert switches(256) == cfg.num_layers


def _made_arrays(text: str, sizes: set[int]) -> list[str]:
    """Instructions of a compiled program, outside fusion bodies, that make a new f32 array of
    one of ``sizes`` elements (copies, transposes, slice fusions); parameters, bitcasts and
    in-place updates (dynamic-update-slice fusions) make none."""
    bodies = set(re.findall(r"calls=(%[\w.-]+)", text))
    made, inside = [], False
    for ln in text.splitlines():
        if head := re.match(r"^(?:ENTRY )?(%[\w.-]+) ", ln):
            inside = head.group(1) in bodies
            continue
        m = re.match(r"\s*(?:ROOT )?(%\S+) = f32\[([0-9,]+)\]\{[0-9,]*\} ([\w-]+)\(", ln)
        if (not inside and m and m.group(3) not in ("parameter", "bitcast", "get-tuple-element")
                and "dynamic-update-slice" not in m.group(1)
                and int(np.prod([int(x) for x in m.group(2).split(",")])) in sizes):
            made.append(ln.strip()[:160])
    return made


@pytest.mark.parametrize("heads", [(4, 4), (8, 8)])
def test_cpu_decode_step_copies_no_cache_span(heads):
    """The engine's one-token step on CPU with equal heads (a cache with span buckets,
    device-chosen span) reads every layer's K and V where they lie: nothing in the compiled
    program makes an array of a layer's span.  The stacked cache's layer spans were copied out
    per layer and step (slice fusions: XLA:CPU's dot takes whole buffers), most of the step's
    time at 8 / 8 heads."""
    from d3d_jax.config import ModelConfig
    from d3d_jax.model.qwen3 import init_model, unstacked

    q, k = heads
    # a head dim of 64: with tiny spans XLA:CPU emits the dot itself and fuses the slice into it
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=q,
                      num_kv_heads=k, head_dim=64)
    graphdef, state = nnx.split(unstacked(init_model(cfg, seed=0)))
    cache = kvc.init_cache(cfg, 1, 200)  # spans (128, 200)

    def step(s, c):
        meta = causal_meta(c.lengths[:, None])
        return nnx.merge(graphdef, s)(jnp.zeros((1, 1), jnp.int32), meta, cache=c,
                                      cache_span=kvc.SpanChoice.of(jnp.max(c.lengths) + 1, c.max_len))

    text = jax.jit(step, donate_argnums=1).lower(state, cache).compile().as_text()
    spans = kvc.span_buckets(cache.max_len)
    assert len(spans) > 1  # buckets in play (what the old cache sliced)
    made = _made_arrays(text, {s * k * cfg.head_dim for s in spans})
    assert not made, made


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_cached_step_reads_head_and_output_projection_in_place(kv_heads):
    """A one-token step of a tied model (XLA:CPU) copies no weight and no cache span: the head
    reads the embedding ``[v, d]`` as it lies, the output projection ``[n, h, d]`` is one
    ``[n·h, d]`` matrix, and equal heads attend to the span where it lies (the embedding and
    o_proj were copied at every step, and with equal heads each layer's K and V span)."""
    from d3d_jax.config import ModelConfig
    from d3d_jax.model.qwen3 import init_model, unstacked

    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=kv_heads, head_dim=32, tie_word_embeddings=True)
    graphdef, state = nnx.split(unstacked(init_model(cfg, seed=0)))
    meta = causal_meta(jnp.full((1, 1), 5, jnp.int32))
    fn = jax.jit(lambda s, c: nnx.merge(graphdef, s)(jnp.zeros((1, 1), jnp.int32), meta, cache=c),
                 donate_argnums=1)
    text = fn.lower(state, kvc.init_cache(cfg, 1, 40)).compile().as_text()
    sizes = {512 * 64, 4 * 32 * 64, 40 * kv_heads * 32}  # embedding, o_proj, a layer's K or V span
    copied = [ln.strip()[:120] for ln in text.splitlines()
              if (m := re.search(r"= f32\[([0-9,]+)\]\{[0-9,]*\} (copy|transpose)\(", ln))
              and int(np.prod([int(x) for x in m.group(1).split(",")])) in sizes]
    assert not copied, copied


def test_cached_step_takes_equal_heads_pairs_by_a_slice():
    """With equal heads a one-token step on CPU multiplies the span against every query head as it
    lies and keeps each head's own pairs by a strided slice: nothing reduces an array of all the
    pairs (a masked sum over them selected and reduced one per layer, for scores and values)."""
    from d3d_jax.config import ModelConfig
    from d3d_jax.model.qwen3 import init_model, unstacked

    span, heads, head_dim = 40, 4, 32
    cfg = ModelConfig(vocab_size=384, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=heads,
                      num_kv_heads=heads, head_dim=head_dim, tie_word_embeddings=True)
    graphdef, state = nnx.split(unstacked(init_model(cfg, seed=0)))
    meta = causal_meta(jnp.full((1, 1), 5, jnp.int32))
    fn = jax.jit(lambda s, c: nnx.merge(graphdef, s)(jnp.zeros((1, 1), jnp.int32), meta, cache=c))
    text = fn.lower(state, kvc.init_cache(cfg, 1, span, layered=False)).as_text()
    pairs = {span * heads * heads, heads * heads * head_dim}
    reduced = [m.group(0) for m in re.finditer(r"stablehlo\.reduce\(%[^)]*\)[^\n]*?: \(tensor<([0-9x]+)xf32>", text)
               if int(np.prod([int(x) for x in m.group(1).split("x")])) in pairs]
    assert not reduced, reduced
