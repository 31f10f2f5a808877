"""Regeneration config: the target rewrites every response of the training data."""

from __future__ import annotations

import dataclasses

from d3d_jax.config.base import DTYPES, TEXT, _require, above, between, one_of
from d3d_jax.config.limits import INT32_MAX, MAX_CACHE_LEN, MAX_SLOTS, check_sampling, require_int
from d3d_jax.config.model import ATTENTION_CHOICES, MeshConfig


# --------------------------------------------------------------------------------------
# Regeneration: the target rewrites every response (spec §2.1)
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RegenerateConfig:
    """Sampling and batching of ``train/regenerate_data.py`` (defaults: the target's own)."""

    # None: the target's generation_config.json (its authors' defaults), else Qwen3's non-thinking
    # T 0.7 / top-p 0.8 / top-k 20; the values used are recorded in every record
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 = off
    # the chat template's enable_thinking (Qwen3): drafters for thinking-mode serving train on
    # thinking-mode responses
    enable_thinking: bool = False
    greedy: bool = False  # overrides temperature/top_p/top_k with argmax decoding
    max_new_tokens: int = 512
    seed: int = 0
    batch_size: int = 8  # rows decoded together (continuous batching: a finished row takes the next prompt)
    max_records: int | None = None  # stop after this many new records (rerun resumes)
    max_prompt_tokens: int | None = None  # None: max_position_embeddings - max_new_tokens
    cache_multiple: int = 64  # the run's one KV cache length (longest prompt + max_new_tokens) is rounded up to this
    # Malformed prompt lines and prompts the template or vocabulary rejects are skipped and listed;
    # more than this fraction of them stops the run before anything is generated.
    max_skipped_fraction: float = 0.01
    process_index: int | None = None  # None: jax.process_index()
    process_count: int | None = None  # None: jax.process_count()
    # cast the target after loading; None: float32 on a CPU (XLA:CPU computes bfloat16 by converting
    # to float32 around each op, the KV cache's every round), as stored on an accelerator
    dtype: str | None = None
    # attention backend: auto (the fused kernels on GPU and TPU, xla on a CPU), xla or pallas
    attention: str = "auto"
    # Each process loads the target onto a mesh over its own devices (prompts, not tensors, are
    # split across processes); num_devices 0 = all of this process's devices.
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    num_devices: int = 0
    # Through an OpenAI-compatible server instead (vLLM, SGLang, infer/serve.py): its API base URL,
    # e.g. http://host:8000/v1 (d3d_jax.training.regen_endpoint); the key comes from --api-key or
    # the OPENAI_API_KEY environment variable, never from a config file.
    endpoint: str | None = None
    model: str | None = None  # the served model's name (None: the server's first)
    concurrency: int = 16  # requests in flight per process
    request_timeout_s: float = 600.0
    retry_s: float = 600.0  # a request retries a down server (5xx, refused, timeout) this long

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(temperature=between(0, 1e6), top_p=above(0, 1), top_k=between(0, INT32_MAX),
                  max_new_tokens=between(1, MAX_CACHE_LEN), seed=between(0, INT32_MAX), batch_size=between(1, MAX_SLOTS),
                  max_records=between(1, INT32_MAX), max_prompt_tokens=between(1, MAX_CACHE_LEN),
                  cache_multiple=between(1, MAX_CACHE_LEN), max_skipped_fraction=between(0, 1),
                  process_index=between(0, 1 << 16), process_count=between(1, 1 << 16), dtype=one_of(*DTYPES),
                  attention=one_of(*ATTENTION_CHOICES),
                  num_devices=between(0, 1 << 16), endpoint=TEXT, model=TEXT, concurrency=between(1, 4096),
                  request_timeout_s=above(0, 1e6), retry_s=between(0, 1e7))

    def validate(self, prefix: str = "regenerate") -> None:
        self.mesh.validate(f"{prefix}.mesh")
        _require(self.num_devices >= 0, f"{prefix}.num_devices", "must be >= 0")
        check_sampling(f"{prefix}.", temperature=0.7 if self.temperature is None else self.temperature,
                       top_p=0.8 if self.top_p is None else self.top_p, top_k=20 if self.top_k is None else self.top_k,
                       seed=self.seed, max_new_tokens=self.max_new_tokens)
        require_int(self.batch_size, f"{prefix}.batch_size", 1, MAX_SLOTS)
        require_int(self.cache_multiple, f"{prefix}.cache_multiple", 1, MAX_CACHE_LEN)
        _require(0 <= self.max_skipped_fraction <= 1, f"{prefix}.max_skipped_fraction",
                 f"must be in [0, 1], got {self.max_skipped_fraction}")
        if self.max_records is not None:
            _require(self.max_records >= 0, f"{prefix}.max_records", "must be >= 0")
        if self.max_prompt_tokens is not None:
            require_int(self.max_prompt_tokens, f"{prefix}.max_prompt_tokens", 1, MAX_CACHE_LEN)
        if self.process_count is not None:
            _require(self.process_count >= 1, f"{prefix}.process_count", "must be >= 1")
        if self.process_index is not None:
            _require(self.process_index >= 0, f"{prefix}.process_index", "must be >= 0")
            if self.process_count is not None:
                _require(self.process_index < self.process_count, f"{prefix}.process_index",
                         f"must be < process_count={self.process_count}, got {self.process_index}")
        _require(self.attention in ATTENTION_CHOICES, f"{prefix}.attention",
                 f"must be one of {'|'.join(ATTENTION_CHOICES)}, got {self.attention!r}")
        if self.dtype is not None:
            _require(self.dtype in DTYPES, f"{prefix}.dtype", f"must be one of {DTYPES}")


