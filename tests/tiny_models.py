"""The tiny Qwen3 target/drafter shapes that the decoding tests share (cheap to compile)."""

from __future__ import annotations

import jax
from flax import nnx

from d3d_jax.config import ModelConfig


def tiny_configs(vocab: int, mask: int) -> tuple[ModelConfig, ModelConfig]:
    """(target, drafter): 2 layers of hidden 32 over 1 layer of hidden 32, GQA in both."""
    target = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, mask_token_id=mask)
    drafter = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=16, mask_token_id=mask)
    return target, drafter


def randomized(model, seed: int, std: float):
    """Every matrix redrawn at ``std`` (norm scales kept): the default 0.02 init makes a tiny
    model repeat one token, which would hide ordering bugs.  Drawn layer by layer (the stacked
    layout unstacked), so the weights are those of the unstacked model the tests were written on."""
    from d3d_jax.model.qwen3 import per_layer, stacked

    graphdef, state = nnx.split(model)
    pure = per_layer(nnx.to_pure_dict(state))
    leaves, tree = jax.tree.flatten(pure)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x if x.ndim == 1 else std * jax.random.normal(k, x.shape, x.dtype)
              for k, x in zip(keys, leaves)]
    nnx.replace_by_pure_dict(state, stacked(jax.tree.unflatten(tree, leaves)))
    return nnx.merge(graphdef, state)


def tiny_pair(vocab: int, mask: int):
    """(target, drafter) of :func:`tiny_configs`, randomized so that greedy outputs vary."""
    from d3d_jax.model.qwen3 import init_model

    tcfg, dcfg = tiny_configs(vocab, mask)
    return (randomized(init_model(tcfg, seed=0), 0, 0.6), randomized(init_model(dcfg, seed=7), 7, 0.3))


def serve(dec, requests, schedule, cancel=None, metrics=None, pick: int = -1):
    """Drive ``dec`` like a server: ``schedule[i]`` = round at which request i arrives (then it
    waits for a free slot); ``cancel`` = {request: round} frees it mid-way.  Returns each
    request's tokens and finish reason (and fills ``metrics[i]`` with its slot metrics).
    ``pick``: which free slot a request takes (the placement packs rows whatever it is)."""
    tokens = {i: [] for i in range(len(requests))}
    reasons, slot_of, queue = {}, {}, []
    rnd = 0
    while len(reasons) < len(requests):
        queue += [i for i, at in enumerate(schedule) if at == rnd]
        for i, at in (cancel or {}).items():
            if at == rnd and i in slot_of:
                dec.free(slot_of.pop(i))
                reasons[i] = "cancelled"
        free = [s for s in range(dec.config.num_slots) if s not in slot_of.values()]  # the caller's slots
        while queue and free:
            i = queue.pop(0)
            slot_of[i] = free.pop(pick)
            dec.insert(dec.prefill(requests[i]), slot_of[i])
        outs = dec.step()
        for i, slot in list(slot_of.items()):
            out = outs.get(slot)  # None: joined behind a round in flight
            if out is None:
                continue
            tokens[i] += out.token_ids
            if out.finished:
                reasons[i] = out.finish_reason
                if metrics is not None:
                    metrics[i] = dec.slot_metrics(slot)
                dec.free(slot_of.pop(i))
        rnd += 1
        assert rnd < 400
    return tokens, reasons
