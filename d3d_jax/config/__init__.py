"""Typed configuration: dataclasses built from YAML files plus ``key=value`` overrides.

Every section is a frozen dataclass.  ``load_config`` merges YAML files (later files win, a
YAML may ``include:`` others), applies dotted ``key=value`` overrides, converts each value to
the declared field type and runs each section's ``validate``.  Any problem raises
``ConfigError`` naming the offending key, before anything is built.

The package is split by domain (``base``: loader and errors; ``yaml_files``: reading YAML; ``model``: model and mesh;
``training``, ``regenerate``, ``pipeline``, ``prune``; the decoding commands' ``decoding``,
``serve``, ``generate``, ``evaluation``, and ``flags`` mapping command-line flags onto fields); everything is re-exported here, so
``from d3d_jax.config import X`` works for every name.
"""

from d3d_jax.config.base import *  # noqa: F401,F403
from d3d_jax.config.model import *  # noqa: F401,F403
from d3d_jax.config.training import *  # noqa: F401,F403
from d3d_jax.config.regenerate import *  # noqa: F401,F403
from d3d_jax.config.pipeline import *  # noqa: F401,F403
from d3d_jax.config.prune import *  # noqa: F401,F403
from d3d_jax.config.decoding import *  # noqa: F401,F403
from d3d_jax.config.serve import *  # noqa: F401,F403
from d3d_jax.config.generate import *  # noqa: F401,F403
from d3d_jax.config.evaluation import *  # noqa: F401,F403
from d3d_jax.config.flags import *  # noqa: F401,F403
