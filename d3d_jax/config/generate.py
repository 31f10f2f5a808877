"""``infer/generate.py``'s config: the models, the decoder, and how to sample and print.

Every flag sets one field (``--temperature`` is ``generate.temperature``, ``--batch-size`` is
``decoder.num_slots`` …; the flag declarations in ``infer/generate.py`` are the table).  The
prompts themselves (``--prompt``, ``--prompt-ids``, ``--prompts-file``, ``--chat``) are input, not
settings, and stay flags; sampling values are checked where every caller's are
(:class:`~d3d_jax.decoding.verify.SamplingParams`), still before any decoding.
"""

from __future__ import annotations

import dataclasses

from d3d_jax.config.base import _require, above, between, one_of
from d3d_jax.config.limits import INT32_MAX, MAX_CACHE_LEN
from d3d_jax.config.decoding import DecoderConfig, ModelPaths, check_section

LOOPS = ("device", "host")


@dataclasses.dataclass(frozen=True)
class GenerateSettings:
    """Sampling, stopping and output of one ``infer/generate.py`` run (the ``generate:`` section)."""

    max_new_tokens: int = 128
    allow_beyond_context: bool = False  # let prompt + max_new_tokens run past max_position_embeddings
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0
    mask_token_id: int | None = None  # None: the drafter's config
    eos_ids: tuple[int, ...] | None = None  # None: the target config's and the tokenizer's EOS
    ignore_eos: bool = False
    stop_ids: tuple[int, ...] = ()  # extra stop token ids
    loop: str = "device"  # device: the fused on-device loop; host: a per-round loop that times draft/verify
    json: bool = False  # one JSON object per prompt
    show_special_tokens: bool = False  # keep EOS, <|im_end|>... in the printed text

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(max_new_tokens=between(1, MAX_CACHE_LEN), temperature=between(0, 1e6), top_p=above(0, 1),
                  top_k=between(0, INT32_MAX), seed=between(0, INT32_MAX), mask_token_id=between(0, INT32_MAX),
                  eos_ids=between(0, INT32_MAX), stop_ids=between(0, INT32_MAX), loop=one_of(*LOOPS))

    def validate(self, prefix: str = "generate") -> None:
        _require(self.max_new_tokens >= 1, f"{prefix}.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        _require(self.loop in LOOPS, f"{prefix}.loop", f"must be one of {'|'.join(LOOPS)}, got {self.loop!r}")


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    models: ModelPaths = dataclasses.field(default_factory=ModelPaths)
    decoder: DecoderConfig = dataclasses.field(default_factory=DecoderConfig)
    generate: GenerateSettings = dataclasses.field(default_factory=GenerateSettings)

    def validate(self) -> None:
        self.models.validate()
        check_section(self.decoder, has_drafter=self.models.drafter is not None)
        self.generate.validate()
