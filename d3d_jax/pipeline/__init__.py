"""The embedded default end to end (issues 8, 23): ``train/pipeline.py`` is its command line.

One typed :class:`Pipeline` (:mod:`.base`: config, paths, shared helpers, the stage order) and a
module per stage, each a function of the pipeline:

1-3. :mod:`.pretraining` — the tokenizer, the target, the small model;
4.   :mod:`.regeneration` — the target's greedy responses to the regeneration prompts;
5.   :mod:`.drafters` — the D3D drafters and their ablations, and which weights ship;
6.   :mod:`.prune` — acceptance-guided pruning against ShortGPT at the same depths;
7.   :mod:`.online` — online τ of every drafter, measured once;
8.   :mod:`.benchmark` — the timed benchmark (``make demo``), reported by :mod:`.report`
     with what :mod:`.measure` measures.
"""

from d3d_jax.pipeline.base import Pipeline

__all__ = ["Pipeline"]
