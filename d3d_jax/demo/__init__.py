"""The embedded default's own material (``make demo``): its corpus (:mod:`.corpus`), its
tokenizer (:mod:`.tokenizer`) and the prompts cut from the corpus (:mod:`.prompts`).  The
pipeline that trains on them is :mod:`d3d_jax.pipeline`."""

from d3d_jax.demo.prompts import continuation_pairs, docstring_prompts

__all__ = ["continuation_pairs", "docstring_prompts"]
