"""``infer/serve.py``'s config: the models, the decoder and the HTTP server (``configs/serve/``).

Every flag of the server sets one of these fields (``--port`` is ``server.port``, ``--mode`` is
``decoder.mode``, ``--max-model-len`` is ``decoder.max_cache_len`` …; the table is the flag
declarations in :mod:`d3d_jax.serving.server`), so a YAML file, flags and ``key=value`` overrides
describe the same thing, checked once at load.
"""

from __future__ import annotations

import dataclasses

from d3d_jax.config.base import TEXT, ConfigError, _require, between, one_of
from d3d_jax.config.decoding import DecoderConfig, ModelPaths, check_section

NUM_SLOTS = 8  # the server's decoder.num_slots when none is given: concurrent requests decoded together
MAX_CACHE_LEN = 2048  # decoder.max_cache_len when none is given, capped at max_position_embeddings
INT32 = 2 ** 31 - 1
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def default_compile_cache() -> str:
    """The cache every command shares (:func:`d3d_jax.compile_cache.default_dir`)."""
    from d3d_jax.compile_cache import default_dir

    return default_dir()


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """The HTTP side of the server (the ``server:`` section)."""

    host: str = "127.0.0.1"  # bind address (default: localhost only)
    port: int = 8000  # 0: a free port, printed on the READY line
    api_key: str | None = None  # require 'Authorization: Bearer KEY'; None: $D3D_API_KEY, unset = open
    served_model_name: str | None = None  # model id in the API; None: the target directory's name
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    max_prompt_tokens: int | None = None  # None: the context length - 1
    default_max_tokens: int = 256  # when a request gives none
    max_queue: int = 4096  # waiting requests beyond this get 503
    # compile every prefill bucket up to this prompt length (0: no warm-up); the first bucket
    # before serving, the others in the background
    warmup_max_prompt: int = 256
    warmup_wait: bool = False  # compile every warm-up bucket before serving (READY only after)
    # persistent XLA compilation cache, so a second start compiles nothing ('none': off)
    compile_cache: str = dataclasses.field(default_factory=default_compile_cache)
    vllm_metrics: bool = False  # /metrics also under vLLM's vllm: names
    log_level: str = "warning"
    # the chat template's variables when a request's chat_template_kwargs leave them out (a JSON
    # object); thinking off: the drafters are trained on non-thinking responses
    default_chat_template_kwargs: str = '{"enable_thinking": false}'
    reasoning_parser: str = "qwen3"  # the thought in reasoning_content, as vLLM's; none: left in content
    tool_call_parser: str = "hermes"  # <tool_call> output as tool_calls, as vLLM's; none: left in content

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(host=TEXT, port=between(0, 65535), api_key=TEXT, served_model_name=TEXT,
                  max_body_bytes=between(1, 1 << 30), max_prompt_tokens=between(1, INT32),
                  default_max_tokens=between(1, INT32), max_queue=between(1, 1 << 20),
                  warmup_max_prompt=between(0, INT32), compile_cache=TEXT, log_level=TEXT,
                  default_chat_template_kwargs=TEXT, reasoning_parser=one_of("qwen3", "none"),
                  tool_call_parser=one_of("hermes", "none"))

    def validate(self, prefix: str = "server") -> None:
        for key, lo, hi in (("port", 0, 65535), ("max_body_bytes", 1, 1 << 30), ("max_prompt_tokens", 1, INT32),
                            ("default_max_tokens", 1, INT32), ("max_queue", 1, 1 << 20),
                            ("warmup_max_prompt", 0, INT32)):
            value = getattr(self, key)
            _require(value is None or lo <= value <= hi, f"{prefix}.{key}", f"must be in [{lo}, {hi}], got {value}")
        _require(self.log_level.lower() in LOG_LEVELS, f"{prefix}.log_level",
                 f"must be one of {'|'.join(LOG_LEVELS)}, got {self.log_level!r}")
        self.template_kwargs(prefix)

    def template_kwargs(self, prefix: str = "server") -> dict:
        """``default_chat_template_kwargs`` as a dict (a ConfigError names the field)."""
        import json

        key = f"{prefix}.default_chat_template_kwargs"
        try:
            value = json.loads(self.default_chat_template_kwargs or "{}")
        except ValueError as e:
            raise ConfigError(f"{key}: is not JSON ({e})") from None
        _require(isinstance(value, dict), key, f"must be a JSON object, got {type(value).__name__}")
        return value


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    models: ModelPaths = dataclasses.field(default_factory=ModelPaths)
    decoder: DecoderConfig = dataclasses.field(default_factory=DecoderConfig)
    server: ServerSettings = dataclasses.field(default_factory=ServerSettings)

    def validate(self) -> None:
        self.models.validate()
        self.server.validate()
        check_section(self.decoder, has_drafter=self.models.drafter is not None)
