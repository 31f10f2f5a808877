"""The embedded default end to end: ``train/pipeline.py`` is its command line.

Each stage is a function of one :class:`Context` (:mod:`.context`: config, paths, the artifacts
the stages share); :mod:`.plan` holds the stage list and runs it:

1-3. :mod:`.pretraining` — the tokenizer, the target, the small model;
4.   :mod:`.regeneration` — the target's greedy responses to the regeneration prompts;
5.   :mod:`.drafters` — the D3D drafters and their ablations, and which weights ship;
6.   :mod:`.prune` — acceptance-guided pruning against ShortGPT at the same depths;
7.   :mod:`.online` — online τ of every drafter, measured once;
8.   :mod:`.benchmark` — the timed benchmark (``make demo``), reported by :mod:`.report`
     with what :mod:`.measure` measures.

The training stages share :mod:`.runs` (one training run, the drafters' data, offline τ).
"""

from d3d_jax.pipeline.context import Context
from d3d_jax.pipeline.plan import missing, run

__all__ = ["Context", "missing", "run"]
