"""Peer comparison: transformers' assisted generation with the same target and drafter.

The D3D drafter is trained with an AR loss on its clean stream too, so it also works as an
ordinary autoregressive assistant: ``target.generate(ids, assistant_model=drafter)``.  Both models
are loaded from exported HF directories (the same weights our engine runs).  τ is the number of
new tokens per target forward (each assisted round is one target forward, prefill included).
"""

from __future__ import annotations

import time
from typing import Sequence


def hf_assisted_generation(target_dir: str, drafter_dir: str, prompts: Sequence[Sequence[int]], *,
                           max_new_tokens: int, eos_token_ids: Sequence[int], pad_token_id: int = 0,
                           reference_outputs: Sequence[Sequence[int]] | None = None,
                           num_threads: int | None = None) -> dict:
    """Greedy plain vs assisted ``generate`` in transformers (float32, CPU, batch 1, same prompts).

    Returns ``{"plain": {...}, "hf_assisted": {...}}`` with time per token, τ, speedup of assisted
    over transformers' own plain decoding, and whether outputs equal ``reference_outputs``
    (our engine's plain greedy outputs) token for token.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if num_threads:
        torch.set_num_threads(num_threads)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = AutoModelForCausalLM.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    calls = {"n": 0}
    target.register_forward_pre_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    common = dict(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=list(eos_token_ids),
                  pad_token_id=pad_token_id, temperature=None, top_p=None, top_k=None)
    modes = (("plain", {}), ("hf_assisted", {"assistant_model": drafter}))
    with torch.no_grad():  # one untimed call each, so lazy initialisation is not billed to a prompt
        for _, extra in modes:
            target.generate(torch.tensor([list(prompts[0])]), **{**common, "max_new_tokens": 4}, **extra)
    acc = {name: {"outputs": [], "seconds": 0.0, "forwards": 0} for name, _ in modes}
    for p in prompts:  # modes interleaved per prompt: load drift on a shared host hits both alike
        ids = torch.tensor([list(p)])
        for name, extra in modes:
            calls["n"] = 0
            t0 = time.perf_counter()
            with torch.no_grad():
                gen = target.generate(ids, attention_mask=torch.ones_like(ids), **common, **extra)
            acc[name]["seconds"] += time.perf_counter() - t0
            acc[name]["forwards"] += calls["n"]
            acc[name]["outputs"].append([int(t) for t in gen[0, ids.shape[1]:]])
    out: dict = {}
    for name, a in acc.items():
        outputs, seconds, forwards = a["outputs"], a["seconds"], a["forwards"]
        n_tok = sum(len(o) for o in outputs)
        r = {"new_tokens": n_tok, "seconds": seconds, "time_per_token_ms": 1e3 * seconds / max(n_tok, 1),
             "tokens_per_s": n_tok / max(seconds, 1e-9), "target_forwards": forwards,
             "tau": n_tok / max(forwards, 1), "target_forwards_per_token": forwards / max(n_tok, 1)}
        if reference_outputs is not None:
            r["equals_engine_plain"] = [list(o) for o in reference_outputs] == outputs
            r["mismatched_outputs"] = sum(list(a) != b for a, b in zip(reference_outputs, outputs))
        r["outputs"] = outputs
        out[name] = r
    out["hf_assisted"]["speedup"] = out["plain"]["time_per_token_ms"] / out["hf_assisted"]["time_per_token_ms"]
    out["hf_assisted"]["equals_hf_plain"] = out["hf_assisted"]["outputs"] == out["plain"]["outputs"]
    for r in out.values():
        r.pop("outputs")
    return out
