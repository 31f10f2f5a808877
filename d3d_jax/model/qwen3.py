"""Qwen3 decoder in Flax NNX: one module for target and drafter (spec §1).

Two ways to run it:

* **whole sequence** – ``model(tokens_bt, meta)``; the attention mask is built inside attention
  from per-token :class:`~d3d_jax.model.masks.TokenMeta` (causal by default, the packed
  block-diffusion row of spec §2.3, or the branch pack of §5);
* **cached** – ``model(tokens_bt, meta, cache=cache, keep=keep_bt)`` appends T tokens per row to
  a position-indexed :class:`~d3d_jax.model.kv_cache.KVCache` or a
  :class:`~d3d_jax.model.paged_kv.PagedKVCache` (rows at different offsets) and
  returns ``(logits, new_cache)``.  The new tokens attend to valid cache slots plus each other
  (by the same metadata rule); only tokens with ``keep`` set are written (the drafter's block
  tokens are not).  ``cache.lengths`` is left to the caller, who knows what was committed.

Parameter layouts (axis letters: b batch, t/s length, d embed, n heads, k kv heads, h head dim,
f mlp, v vocab): ``q_proj.kernel [d,n,h]``, ``k_proj/v_proj.kernel [d,k,h]``,
``o_proj.kernel [n,h,d]``, MLP ``[d,f]``/``[f,d]``, ``embed_tokens.embedding [v,d]``,
``lm_head.kernel [d,v]`` (absent when tied).  Each parameter carries those axes by their logical
names (``embed``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``, ``vocab``, ``norm``) in its
``out_sharding`` metadata; ``parallel.sharding`` maps them onto a mesh.

The decoder layers are one :class:`DecoderLayer` whose parameters are stacked on a leading
``layers`` axis (``model.layers.mlp.up_proj.kernel [L,d,f]``), run by one ``lax.scan`` with
the KV cache's layer axis indexed by the scan step: every program holds the layer once, so
compile time does not grow with depth (MaxText's ``scan_layers``).  :func:`per_layer` and
:func:`stacked` convert a pure dict between that layout and ``{"layers": {i: ...}}``.

Decoders run :func:`unstacked` models instead (``model.layers[i]``, a Python loop over the
layers): on GPU and CPU, XLA copies each step's slice of stacked weights before its matmul
(a second read and a write of every weight per token: a 2-layer 8B-wide plain step read 17 %
more bytes); a scan costs decoding nothing only where the slice fuses into the dot (TPU).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from d3d_jax.config import ModelConfig
from d3d_jax.model import kv_cache as kvc
from d3d_jax.model.attention import CacheLayer, CacheSpans, HeadsFirstLayer, attend, kernel_reads_pages
from d3d_jax.model.flash_attention import save_flash_forward
from d3d_jax.model.masks import TokenMeta, cache_key_meta, default_meta
from d3d_jax.model.paged_kv import PagedKVCache
from d3d_jax.model.rope import frequencies as rope_frequencies
from d3d_jax.parallel.sharding import shard

_INIT = nnx.initializers.normal(0.02)


def _param(rngs: nnx.Rngs, shape: Sequence[int], dtype, axes: tuple[str | None, ...]) -> nnx.Param:
    return annotated(_INIT(rngs.params(), tuple(shape), dtype), axes)


def annotated(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """A parameter with its logical axes (``parallel.sharding`` reads them to place it).

    Not sharded when made (``eager_sharding=False``): placement keeps a dimension that a mesh
    axis does not divide replicated, which flax's eager sharding would refuse.
    """
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype):
        self.scale = annotated(jnp.ones((dim,), param_dtype), ("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        # As transformers: normalise in float32, cast back, then scale.
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * xf.astype(x.dtype)


def rope(x_btnh: jax.Array, positions_bt: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Rotary embedding, HF ``rotate_half`` convention, computed in float32, with the config's
    RoPE scaling (linear, dynamic, yarn, longrope, llama3: :mod:`d3d_jax.model.rope`)."""
    h = x_btnh.shape[-1]
    inv_freq, attention = rope_frequencies(positions_bt, h, cfg.rope_theta, cfg.rope_scaling,
                                           cfg.max_position_embeddings)
    freqs = positions_bt.astype(jnp.float32)[..., None] * inv_freq  # [b,t,h/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if attention != 1.0:  # YaRN / longrope scale cos and sin (so q·k by its square)
        cos, sin = cos * attention, sin * attention
    xf = x_btnh.astype(jnp.float32)
    x1, x2 = xf[..., : h // 2], xf[..., h // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x_btnh.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nnx.Module()
        self.q_proj.kernel = _param(rngs, (d, n, h), pd, ("embed", "heads", "head_dim"))
        self.k_proj = nnx.Module()
        self.k_proj.kernel = _param(rngs, (d, k, h), pd, ("embed", "kv_heads", "head_dim"))
        self.v_proj = nnx.Module()
        self.v_proj.kernel = _param(rngs, (d, k, h), pd, ("embed", "kv_heads", "head_dim"))
        self.o_proj = nnx.Module()
        self.o_proj.kernel = _param(rngs, (n, h, d), pd, ("heads", "head_dim", "embed"))
        self.q_norm = RMSNorm(h, cfg.rms_norm_eps, pd)
        self.k_norm = RMSNorm(h, cfg.rms_norm_eps, pd)
        self.cfg = cfg

    def __call__(self, x_btd: jax.Array, meta: TokenMeta, prefix: CacheLayer | None):
        cfg = self.cfg
        dt = x_btd.dtype
        q = jnp.einsum("btd,dnh->btnh", x_btd, self.q_proj.kernel[...].astype(dt))
        k = jnp.einsum("btd,dkh->btkh", x_btd, self.k_proj.kernel[...].astype(dt))
        v = jnp.einsum("btd,dkh->btkh", x_btd, self.v_proj.kernel[...].astype(dt))
        q = rope(self.q_norm(q), meta.positions, cfg)
        k = rope(self.k_norm(k), meta.positions, cfg)
        q = shard(q, ("batch", "length", "act_heads", "head_dim"))
        k = shard(k, ("batch", "length", "act_kv_heads", "head_dim"))
        v = shard(v, ("batch", "length", "act_kv_heads", "head_dim"))

        out = attend(q, k, v, meta, meta, backend=cfg.attention_backend, prefix=prefix)
        # one [n·h] contraction of row-major arrays: as two dims, XLA:CPU copied o_proj's kernel
        # into the attention output's head order at every decode step
        b, t, n, h = out.shape
        y = out.reshape(b, t, n * h) @ self.o_proj.kernel[...].astype(dt).reshape(n * h, -1)
        return y, k, v


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nnx.Module()
        self.gate_proj.kernel = _param(rngs, (d, f), pd, ("embed", "mlp"))
        self.up_proj = nnx.Module()
        self.up_proj.kernel = _param(rngs, (d, f), pd, ("embed", "mlp"))
        self.down_proj = nnx.Module()
        self.down_proj.kernel = _param(rngs, (f, d), pd, ("mlp", "embed"))

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        dt = x_btd.dtype
        gate = x_btd @ self.gate_proj.kernel[...].astype(dt)
        up = x_btd @ self.up_proj.kernel[...].astype(dt)
        hidden = shard(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
        return hidden @ self.down_proj.kernel[...].astype(dt)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, meta, prefix):
        attn, k, v = self.self_attn(self.input_layernorm(x), meta, prefix)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return shard(x, ("batch", "length", "act_embed")), k, v


def _layer_forward(layer, x, meta, prefix):
    return layer(x, meta, prefix)


@jax.custom_vjp
def grad_fence(params, x):
    """Identity on ``(params, x)``; in the backward, ``x``'s cotangent is released only once
    ``params``' cotangent (their whole gradient, reduce-scattered to their sharding) is complete.

    Without it XLA may defer every weight-gradient matmul to the end of the backward: nothing but
    the optimiser reads them, so on a TPU pod (whose scheduler only minds the HBM limit) the
    inputs of those matmuls (~7 activations per layer) stayed live for all layers at once, 0.35
    GiB per layer and chip for the D3D-8B step.  The scanned layer stack bounds this by itself
    (a scan's backward finishes each step's gradients before the next), so only the head is fenced.
    """
    return params, x


def _grad_fence_fwd(params, x):
    return (params, x), None


def _grad_fence_bwd(_, cts):
    return tuple(jax.lax.optimization_barrier(cts))


grad_fence.defvjp(_grad_fence_fwd, _grad_fence_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def forward_shard(x: jax.Array, axes: tuple) -> jax.Array:
    """``shard(x, axes)`` whose cotangent passes unconstrained: resharding a value for what the
    backward keeps of it must not reshard its gradient too (a slice and a gather per layer)."""
    return shard(x, axes)


forward_shard.defvjp(lambda x, axes: (shard(x, axes), None), lambda axes, _, ct: (ct,))


def remat_policy(name: str):
    """``jax.checkpoint`` policy of a ``ModelConfig.remat_policy`` name (not ``"none"``).

    ``full`` saves only each layer's input; ``save_dots`` every matmul output (with the XLA
    backend that includes the [L, L] scores); ``save_dots_no_batch`` the weight matmuls only;
    ``save_attention`` the fused kernel's output and log-sum-exp (O(L)), so the backward reruns
    the projections and MLP but not the attention forward (with the XLA backend: as ``full``).
    """
    cp = jax.checkpoint_policies
    return {"full": None, "save_dots": cp.dots_saveable,
            "save_dots_no_batch": cp.dots_with_no_batch_dims_saveable,
            "save_attention": save_flash_forward}[name]


class Qwen3(nnx.Module):
    """Qwen3ForCausalLM.  ``config`` is a :class:`ModelConfig` (static)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, stacked: bool = True):
        config.validate()
        self.config = config
        pd = jnp.dtype(config.param_dtype)
        self.embed_tokens = nnx.Module()
        self.embed_tokens.embedding = _param(rngs, (config.vocab_size, config.hidden_size), pd, ("vocab", "embed"))
        layers = [DecoderLayer(config, rngs) for _ in range(config.num_layers)]
        self.layers = stack_layers(layers) if stacked else nnx.List(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pd)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Module()
            self.lm_head.kernel = _param(rngs, (config.hidden_size, config.vocab_size), pd, ("embed", "vocab"))

    def embed(self, tokens_bt: jax.Array) -> jax.Array:
        dt = jnp.dtype(self.config.dtype)
        emb = self.embed_tokens.embedding[...]
        return shard(jnp.take(emb, tokens_bt, axis=0).astype(dt), ("batch", "length", "act_embed"))

    def head_kernel(self) -> jax.Array:
        """The LM head ``[d, v]`` as stored (the embedding's transpose when tied)."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.embedding[...].T
        return self.lm_head.kernel[...]

    def logits(self, x_btd: jax.Array, kernel: jax.Array | None = None) -> jax.Array:
        """``kernel``: the head as :meth:`head_kernel` gives it (default: that).

        A tied head is read as the embedding ``[v, d]`` it is: the product through its transpose
        made XLA:CPU copy the whole embedding into ``[d, v]`` at every decode step."""
        dt = jnp.dtype(self.config.dtype)
        if kernel is None and self.config.tie_word_embeddings:
            out = jnp.einsum("btd,vd->btv", x_btd, self.embed_tokens.embedding[...].astype(dt),
                             preferred_element_type=jnp.float32)
        else:
            w = (self.head_kernel() if kernel is None else kernel).astype(dt)
            out = jnp.einsum("btd,dv->btv", x_btd, w, preferred_element_type=jnp.float32)
        return shard(out, ("batch", "length", "act_vocab"))

    def _run_layers(self, x, meta: TokenMeta, prefix_of, keep_each: bool):
        """Every layer by one ``lax.scan`` over the stacked parameters; ``prefix_of(i)`` is layer
        ``i``'s cache prefix (None without a cache).

        Returns ``(x, new_k [L,B,T,K,H], new_v, each layer's output [L,B,T,D] | None)``.
        """
        remat = self.config.layer_remat
        if isinstance(self.layers, nnx.List):  # unstacked (decoding): a loop, each layer's own weights
            fwd = _layer_forward if remat == "none" else nnx.remat(
                _layer_forward, prevent_cse=True, policy=remat_policy(remat))
            outs = [None] * len(self.layers)
            for i, layer in enumerate(self.layers):
                x, k, v = fwd(layer, x, meta, prefix_of(i))
                outs[i] = (k, v, x)
            k, v, each = (jnp.stack(o) if o[0] is not None else None for o in zip(*outs))
            return x, k, v, each if keep_each else None
        graphdef, params = nnx.split(self.layers)

        def body(x, step):
            layer_params, i = step
            layer = nnx.merge(graphdef, layer_params)
            x, k, v = layer(forward_shard(x, ("batch", "length", "act_embed")), meta, prefix_of(i))
            return x, (k, v, x if keep_each else None)

        if remat != "none":
            saved = jax.checkpoint(body, prevent_cse=False, policy=remat_policy(remat))
            # the scan keeps each layer's input for the backward: a sequence slice per
            # tensor-parallel chip, not one whole copy on each (gathered again in the layer)
            body = lambda x, step: saved(forward_shard(x, ("batch", "saved_length", "act_embed")), step)  # noqa: E731
        steps = (params, jnp.arange(self.config.num_layers, dtype=jnp.int32))
        x, (new_k, new_v, each) = jax.lax.scan(body, x, steps)
        return x, new_k, new_v, each

    def _cache_prefix(self, cache, cache_span):
        """``i -> `` layer ``i``'s attention prefix: the whole stacked cache and the layer index
        (a fused kernel reads the span in place), at one span or a device-chosen one of several."""
        paged = isinstance(cache, PagedKVCache)
        # the kernels skip dead key tiles themselves; a paged span they cannot read through its
        # table is a gather whose cost follows the span, so it keeps the buckets
        fused = self.config.attention_backend != "xla" and (
            not paged or kernel_reads_pages(self.config.attention_backend, cache.page_size))
        if isinstance(cache_span, kvc.SpanChoice) and fused:
            cache_span = max(cache_span.spans)
        spans = cache_span.spans if isinstance(cache_span, kvc.SpanChoice) else (
            cache.max_len if cache_span is None else int(cache_span),)
        if not 0 < max(spans) <= cache.max_len:
            raise ValueError(f"cache_span {cache_span} must be in [1, cache length {cache.max_len}]")
        if isinstance(cache, (kvc.LayerKVCache, kvc.LayerKVWindow)):
            return _layer_prefix(cache, cache_span)
        metas = tuple(cache_key_meta(cache.lengths, s) for s in spans)
        if paged:
            return cache.prefix_of(metas, getattr(cache_span, "index", None))
        if len(spans) == 1:
            return lambda i: CacheLayer(cache.k_lbskh, cache.v_lbskh, metas[0], i)
        return lambda i: CacheSpans(cache.k_lbskh, cache.v_lbskh, metas, cache_span.index, i)

    def __call__(self, tokens_bt: jax.Array, meta: TokenMeta | None = None,
                 cache: kvc.KVCache | None = None, keep: jax.Array | None = None, *,
                 return_hidden_states: bool = False, logits_start: int = 0,
                 cache_span: int | None = None, defer_cache_write: bool = False):
        """Logits ``[B, T, V]`` (float32); with ``cache``: ``(logits, new_cache)``.

        ``return_hidden_states`` adds the list of every layer's input plus the final
        (pre-norm) residual stream, ``num_layers + 1`` arrays ``[B, T, D]``, as the last output.
        ``logits_start`` (static) computes logits only for tokens ``logits_start..T-1``
        (``[B, T - logits_start, V]``): a drafter needs them only on its block slots, and the
        vocabulary projection is a large share of a small model's work.
        ``cache_span`` (static) attends only to cache slots ``< cache_span``; the caller promises
        every valid slot lies there (lengths <= cache_span).  Attention over a fixed-length cache
        otherwise costs the whole cache per step; writes still go to the full cache.  A
        :class:`~d3d_jax.model.kv_cache.SpanChoice` picks one of several spans on the device (the
        attention alone switches; a fused-kernel backend, which skips dead tiles, takes the largest).
        ``defer_cache_write`` returns a :class:`~d3d_jax.model.kv_cache.PendingWrite` instead of
        the new cache (apply it with ``write.apply(cache)``): inside a ``lax.switch`` branch an
        in-place cache write would make XLA copy the whole cache first.
        """
        tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
        b, t = tokens_bt.shape
        if meta is None:
            meta = default_meta(b, t)
        x = self.embed(tokens_bt)
        hidden = [x]
        prefix_of = lambda i: None  # noqa: E731
        if cache is not None:
            prefix_of = self._cache_prefix(cache, cache_span)
            if keep is None:
                keep = (meta.block_ids < 0) & meta.valid
        x, new_k, new_v, per_layer_x = self._run_layers(x, meta, prefix_of, return_hidden_states)
        if cache is not None:
            keep = _after(keep, x)
        if return_hidden_states:
            hidden += list(per_layer_x)
        if not 0 <= logits_start < t:
            raise ValueError(f"logits_start {logits_start} must be in [0, {t})")
        head = None
        if cache is None:  # the last layer's backward waits for the head's weight gradient
            head, x = grad_fence(self.head_kernel(), x)
        logits = self.logits(self.norm(x[:, logits_start:] if logits_start else x), head)
        outs: tuple = (logits,)
        if cache is not None:
            write = kvc.PendingWrite(new_k, new_v, meta.positions, keep)
            outs += (write if defer_cache_write else write.apply(cache),)
        if return_hidden_states:
            outs += (hidden,)
        return outs[0] if len(outs) == 1 else outs


def _layer_prefix(cache, cache_span):
    """``i ->`` layer ``i`` of a per-layer cache, read whole: on CPU a span cut from it would be a
    copy per layer and step that costs more than the masked slots it skips (8 / 8 heads, 576 slots:
    0.23 ms a step whole, 0.58 ms at a 256-slot span).  A static span (a prefill's one slot) still
    cuts: XLA would fold the attention over a whole fresh zero cache at compile time."""
    span = cache.max_len if cache_span is None or isinstance(cache_span, kvc.SpanChoice) else int(cache_span)
    meta = cache_key_meta(cache.lengths, span)

    def prefix(i):
        k, v = cache.layer(i)
        return HeadsFirstLayer(k[:, :, :span], v[:, :, :span], meta)

    return prefix


def _after(keep_bt: jax.Array, x_btd: jax.Array) -> jax.Array:
    """``keep_bt`` unchanged, as a value computed from the last layer's output ``x_btd``.

    XLA writes a cache in place only once every read of the old cache is ordered before the
    write, and copy insertion sees order only in data dependencies (XLA:CPU drops an
    ``optimization_barrier`` before it): without this the write copied the whole cache twice
    per K and V and step (on CPU, 40 % of a step at 8 / 8 heads and 672 slots).
    An argmax index is never negative, so the mask keeps its value.
    """
    return keep_bt & (jnp.argmax(x_btd, axis=-1) >= 0)


def set_config(model: Qwen3, cfg: ModelConfig) -> Qwen3:
    """Give ``model`` a config that differs in runtime fields only (attention backend, remat, dtype).

    The (stacked) attention layer keeps its own reference to the config: assigning
    ``model.config`` alone left it on the old attention backend.  Not validated here, so a CPU host can set up a
    GPU backend for a compile-only program (``infer/bench.py compile``).
    """
    model.config = cfg
    for layer in (model.layers if isinstance(model.layers, nnx.List) else [model.layers]):
        layer.self_attn.cfg = cfg
    return model


def init_model(cfg: ModelConfig, seed: int = 0) -> Qwen3:
    return Qwen3(cfg, rngs=nnx.Rngs(params=seed))


def abstract_model(cfg: ModelConfig, stacked: bool = True) -> Qwen3:
    """A model whose parameters are ShapeDtypeStructs (no memory); fill with ``nnx.update``."""
    return nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(params=0), stacked=stacked))


def unstacked(model: Qwen3) -> Qwen3:
    """``model`` with one module per layer (a copy of the weights; an unstacked model as it is):
    what decoders run (module doc).  Abstract models stay abstract."""
    if isinstance(model.layers, nnx.List):
        return model
    # built on the reference backend, then given the model's (a compile-only GPU backend on a CPU host)
    new = abstract_model(dataclasses.replace(model.config, attention_backend="xla"), stacked=False)
    state = nnx.state(new)
    nnx.replace_by_pure_dict(state, per_layer(nnx.to_pure_dict(nnx.state(model))))
    nnx.update(new, state)
    return set_config(new, model.config)


def remove_layers(model: Qwen3, layers: Sequence[int]) -> Qwen3:
    """A new model without ``layers`` (renumbered, config updated); arrays are shared, not copied."""
    n = model.config.num_layers
    drop = sorted(set(int(i) for i in layers))
    for i in drop:
        if not 0 <= i < n:
            raise ValueError(f"remove_layers: layer {i} out of range [0, {n})")
    if len(drop) >= n:
        raise ValueError("remove_layers: cannot remove every layer")
    keep = [i for i in range(n) if i not in drop]
    new_cfg = dataclasses.replace(model.config, num_layers=len(keep))
    pure = nnx.to_pure_dict(nnx.state(model))
    rows = jnp.asarray(keep, jnp.int32)
    pure["layers"] = jax.tree.map(lambda x: jnp.take(x, rows, axis=0), pure["layers"])
    new_model = abstract_model(new_cfg)
    new_state = nnx.state(new_model)
    nnx.replace_by_pure_dict(new_state, pure)
    nnx.update(new_model, new_state)
    return new_model


def stack_layers(layers: Sequence[nnx.Module]) -> nnx.Module:
    """One module like ``layers[0]`` whose parameters stack every layer's on a leading axis
    (logical name ``layers``, never sharded)."""
    graphdef, first = nnx.split(layers[0])
    states = [first] + [nnx.state(layer) for layer in layers[1:]]

    def stack(*variables):
        values = jnp.stack([v[...] for v in variables])
        axes = variables[0].get_metadata().get("out_sharding")
        return annotated(values, ("layers",) + tuple(axes)) if axes is not None else nnx.Param(values)

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=is_var))


def layer_at(model: Qwen3, i: int) -> DecoderLayer:
    """Layer ``i`` as a module of its own (a copy of its rows: editing it leaves ``model`` as it is)."""
    graphdef, state = nnx.split(model.layers)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x[i], state))


def per_layer(pure: dict) -> dict:
    """A pure parameter dict with ``layers`` as ``{i: layer i's dict}`` (host or device arrays)."""
    stacked_layers = pure["layers"]
    n = jax.tree.leaves(stacked_layers)[0].shape[0]

    def row(x, i):
        if isinstance(x, jax.ShapeDtypeStruct):  # an abstract model's
            return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
        return x[i]

    out = dict(pure)
    out["layers"] = {i: jax.tree.map(lambda x: row(x, i), stacked_layers) for i in range(n)}
    return out


def stacked(pure: dict) -> dict:
    """The inverse of :func:`per_layer`."""
    layers = pure["layers"]
    out = dict(pure)
    out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *(layers[i] for i in sorted(layers)))
    return out
