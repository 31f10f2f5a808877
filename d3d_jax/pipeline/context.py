"""The :class:`Context` every stage is a function of: the embedded default's config, where each
output goes, and the artifacts the stages share (the tokenizer and its special ids, shipped
models).  It knows no stage: the stage list is :mod:`.plan`'s."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from d3d_jax import config as C
from d3d_jax.demo import tokenizer as tok_lib
from d3d_jax.pipeline.common import log


class Context:
    """Stages write under ``cfg.out_dir`` (the shipped artifacts) and are skipped when their output
    exists; scratch (training checkpoints, the tokenised corpus, unshipped weights) lives under
    ``work_dir`` (``runs/``).  ``rebuild=True`` deletes both first."""

    def __init__(self, cfg: C.PipelineConfig, work_dir: str = "runs/pipeline", rebuild: bool = False,
                 update_artifacts: bool = False):
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.work = Path(work_dir)
        # A run's benchmark goes under work_dir (untracked); the shipped reference results in
        # out_dir/eval change only when asked (--update-artifacts) or when out_dir is rebuilt.
        self.update_artifacts = update_artifacts or rebuild
        if rebuild:
            for d in (self.out, self.work):
                if d.exists():
                    log(f"--rebuild: removing {d}")
                    shutil.rmtree(d)
        self.out.mkdir(parents=True, exist_ok=True)
        self.timings: dict[str, float] = {}  # seconds per stage that ran
        self._tokenizer = None

    # ---- paths --------------------------------------------------------------------------------
    @property
    def tokenizer_dir(self) -> Path:
        return self.out / "tokenizer"

    def model_dir(self, name: str) -> Path:
        return self.out / "models" / name

    def drafter_dir(self, name: str) -> Path:
        return self.out / "drafters" / name

    @property
    def prune_dir(self) -> Path:
        """Stage 6's shipped results (the pruned weights stay under the work dir)."""
        return self.out / "pruning"

    @property
    def online_path(self) -> Path:
        """Stage 7's online τ of every drafter, measured once when the weights exist."""
        return self.out / "online_tau.json"

    @property
    def eval_dir(self) -> Path:
        """Where this run's benchmark writes (``work_dir/eval``)."""
        return self.work / "eval"

    @property
    def shipped_eval_dir(self) -> Path:
        """The reference results shipped with the artifacts (``out_dir/eval``)."""
        return self.out / "eval"

    @property
    def regen_path(self) -> Path:
        return self.out / "data" / "regenerated.jsonl"

    def regen_split(self, split: str) -> Path:
        return self.out / "data" / f"regenerated_{split}.jsonl.gz"  # 7x smaller shipped

    def weights_dir(self, name: str) -> Path | None:
        """Where drafter ``name``'s weights are: shipped under out_dir, or kept under the work dir
        (:func:`d3d_jax.pipeline.drafters.unship_weights`), or None (a fresh clone has only the
        shipped ones)."""
        for d in (self.drafter_dir(name), self.work / "drafters" / name):
            if (d / "model.safetensors").exists():
                return d
        return None

    # ---- shared helpers -----------------------------------------------------------------------
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
        return self._tokenizer

    def special_ids(self) -> dict[str, int]:
        t = self.tokenizer()
        return {name: int(t.convert_tokens_to_ids(tok)) for name, tok in
                (("eos", tok_lib.IM_END), ("pad", tok_lib.ENDOFTEXT), ("mask", tok_lib.MASK))}

    def eos_ids(self) -> tuple[int, ...]:
        ids = self.special_ids()
        return (ids["eos"], ids["pad"])

    def model_config(self, mc: C.ModelConfig, **extra) -> C.ModelConfig:
        """``mc`` with this tokenizer's vocabulary and special ids, trained in float32 whatever the
        stored dtype of an init model."""
        ids = self.special_ids()
        return dataclasses.replace(mc, vocab_size=len(self.tokenizer()), eos_token_id=ids["eos"],
                                   pad_token_id=ids["pad"], bos_token_id=None, param_dtype="float32",
                                   dtype="float32", **extra)

    @staticmethod
    def load(path: Path):
        """A shipped model for decoding or training: stored in bfloat16 or float32, run in float32
        (on a CPU, float32 matmuls are the fast ones, and the benchmark compares like with like)."""
        from d3d_jax.io.checkpoint import load_model

        return load_model(str(path), dtype="float32")
