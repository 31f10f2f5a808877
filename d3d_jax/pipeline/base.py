"""The typed :class:`Pipeline`: the embedded default's config, where each output goes, the shared
helpers every stage uses (tokenizer, model configs, one training run, offline τ), and the order
of the stages.  The stages themselves are this package's other modules."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np

from d3d_jax import config as C
from d3d_jax.demo import tokenizer as tok_lib
from d3d_jax.errors import D3DError
from d3d_jax.pipeline.common import DEV_BATCHES, log, write_json  # noqa: F401  (stages and callers read them here too)


class StageStopped(D3DError):
    """A training stage that SIGTERM / SIGINT stopped after saving its checkpoint; the command
    exits with 128 + the signal, as ``train/train_drafter.py`` does, and a rerun resumes it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def finished(trainer, name: str, steps: int, run_dir: Path) -> None:
    """Raise :class:`StageStopped` if a signal stopped ``trainer`` early: it saved a checkpoint
    but exported nothing, and the stage must not go on without an export."""
    if trainer.stop_signal is not None:
        raise StageStopped(f"training run {name!r} stopped by signal {trainer.stop_signal} at step "
                           f"{trainer.step} of {steps}, its checkpoint saved in {run_dir / 'checkpoints'}; "
                           "rerun the same command to resume", trainer.stop_signal)


class Pipeline:
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
        self.timings: dict[str, float] = {}
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
        return self.out / "data" / f"regenerated_{split}.jsonl"

    def weights_dir(self, name: str) -> Path | None:
        """Where drafter ``name``'s weights are: shipped under out_dir, or kept under the work dir
        (:func:`d3d_jax.pipeline.drafters.unship_weights`), or None (a fresh clone has only the
        shipped ones)."""
        for d in (self.drafter_dir(name), self.work / "drafters" / name):
            if (d / "model.safetensors").exists():
                return d
        return None

    # ---- the stages, in order -----------------------------------------------------------------
    def stage(self, name: str, done: bool, fn: Callable[[], None]) -> None:
        if done:
            log(f"stage {name}: output exists, skipped")
            return
        log(f"stage {name}: running")
        t0 = time.time()
        fn()
        self.timings[name] = time.time() - t0
        log(f"stage {name}: done in {self.timings[name]:.0f}s")

    def stages(self) -> list[tuple[str, Callable[[], bool], Callable[[], None]]]:
        """Stages 1-7 in order: ``(name, is its output there?, build it)``; the checks are read
        when the stage's turn comes (an earlier stage changes what a later one needs)."""
        from d3d_jax.pipeline import drafters, online, pretraining, prune, regeneration

        c = self.cfg
        out = [("1-tokenizer", lambda: (self.tokenizer_dir / "tokenizer.json").exists(),
                lambda: pretraining.train_tokenizer(self)),
               ("2-pretrain-target", lambda: (self.model_dir("target") / "config.json").exists(),
                lambda: pretraining.pretrain(self, "target", c.target)),
               # The small model only seeds drafters; once they exist it is not needed (nor shipped).
               ("3-pretrain-small", lambda: (self.model_dir("small") / "config.json").exists()
                or not drafters.small_needed(self), lambda: pretraining.pretrain(self, "small", c.small)),
               # The training split ships (a drafter retrains without regenerating); once every
               # drafter exists only dev is needed, so a checkout without it runs nothing here.
               ("4-regenerate", lambda: self.regen_split("dev").exists()
                and (self.regen_split("train").exists() or drafters.all_trained(self)),
                lambda: regeneration.regenerate(self))]
        out += [(f"5-drafter-{v.name}", lambda v=v: (self.drafter_dir(v.name) / "result.json").exists(),
                 lambda v=v: drafters.train_drafter(self, v)) for v in c.drafters]
        if c.prune_drafter:
            out.append(("6-prune", lambda: (self.prune_dir / "result.json").exists(), lambda: prune.prune(self)))
        out.append(("7-online-tau", lambda: online.measured(self), lambda: online.measure_online(self)))
        return out

    def missing(self) -> list[str]:
        """The stages whose output is not under out_dir now (none, for the shipped artifacts and
        their config: ``make demo`` then runs only the benchmark)."""
        return [name for name, done, _ in self.stages() if not done()]

    def run(self, evaluate: bool = True) -> dict | None:
        from d3d_jax.pipeline import benchmark, drafters

        for name, done, fn in self.stages():
            self.stage(name, done(), fn)
        drafters.unship_weights(self)
        return benchmark.benchmark(self) if evaluate else None

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

    def train_run(self, name: str, model_cfg: C.ModelConfig, data: C.DataConfig, objective: C.ObjectiveConfig,
                  optim: C.OptimConfig, steps: int, init_from: str = "", seed: int = 0,
                  eval_every: int = 0) -> tuple[Path, list[float]]:
        """One training-loop run under ``work_dir/runs/name`` (resumed if interrupted): its HF
        export and the train losses."""
        from d3d_jax.training import loop

        run_dir = self.work / "runs" / name
        cfg = C.TrainRunConfig(
            model=model_cfg, mesh=C.MeshConfig(data=1, fsdp=1, tensor=1), data=data, objective=objective,
            optim=optim, num_devices=1,
            train=C.TrainConfig(steps=steps, init_from=init_from, seed=seed, out_dir=str(run_dir),
                                log_every=25, eval_every=eval_every, keep_checkpoints=1,
                                # an interrupted stage resumes from its last tenth
                                checkpoint_every=max(25, steps // 10),
                                async_checkpointing=False, resume=True, export_params=False,
                                export_hf=True, progress_bar=True, aot_compile=False))
        cfg.validate()
        trainer = loop.run(cfg, tokenizer=self.tokenizer())
        finished(trainer, name, steps, run_dir)
        losses = [r["loss"] for r in trainer.history if "loss" in r] if hasattr(trainer, "history") else []
        return run_dir / "export" / "hf", losses

    def loss_curve(self, run_name: str) -> list[dict]:
        """Per dev evaluation of a training run: step, dev loss, dev τ and the mean train loss
        since the previous evaluation (from its ``metrics.jsonl``; a resumed run's newest line wins)."""
        path = self.work / "runs" / run_name / "metrics.jsonl"
        if not path.exists():
            return []
        train: dict[int, float] = {}
        dev: dict[int, dict] = {}
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "eval/loss" in rec:
                dev[rec["step"]] = rec
            elif "loss" in rec:
                train[rec["step"]] = rec["loss"]
        curve, last = [], 0
        for step in sorted(dev):
            window = [x for k, x in train.items() if last < k <= step]
            curve.append({"step": step, "train_loss": float(np.mean(window)) if window else None,
                          "dev_loss": dev[step]["eval/loss"], "dev_tau": dev[step].get("eval/tau")})
            last = step
        return curve

    def ship_tokenizer(self, model_dir: Path) -> None:
        """The tokenizer beside the weights, so every command takes the model dir alone."""
        for f in self.tokenizer_dir.iterdir():
            if f.is_file():
                shutil.copy2(f, model_dir / f.name)

    @staticmethod
    def store_compact(hf_dir: Path) -> None:
        """Re-save a model in bfloat16 (half the shipped size; every stage runs it in float32)."""
        from d3d_jax.io.checkpoint import load_model
        from d3d_jax.io.hf import save_qwen3

        model = load_model(str(hf_dir))
        extra = {k: getattr(model.config, k) for k in ("mask_token_id", "block_size")
                 if getattr(model.config, k) is not None}
        save_qwen3(model, hf_dir, dtype="bfloat16", extra_config=extra)

    # ---- the drafters' data and offline τ -----------------------------------------------------
    def drafter_data(self) -> C.DataConfig:
        c = self.cfg
        return C.DataConfig(mode="d3d", train_path=str(self.regen_split("train")),
                            dev_path=str(self.regen_split("dev")), tokenizer=str(self.tokenizer_dir),
                            packed_length=c.drafter_packed_length, num_anchors=c.drafter_num_anchors,
                            block_size=c.block_size, batch_size=c.drafter_batch_size, seed=c.seed,
                            dev_batches=2, mask_token_id=self.special_ids()["mask"],
                            pad_token_id=self.special_ids()["pad"])

    def dev_batches(self, **data_changes) -> list[dict]:
        """The dev split's first (up to) 8 batches, unshuffled: every offline τ in the report."""
        from d3d_jax.training import data as data_lib

        dc = dataclasses.replace(self.drafter_data(), **data_changes)
        ds, _ = data_lib.build_dataset(dc, dc.dev_path, tokenizer=self.tokenizer(),
                                       mask_token_id=dc.mask_token_id, seed=dc.seed + 12345, shuffle=False)
        n = max(1, min(DEV_BATCHES, len(ds) if hasattr(ds, "__len__") else DEV_BATCHES))
        return data_lib.take_batches(ds, n)

    def offline_tau(self, model, batches: list[dict] | None = None) -> dict:
        """Offline τ (spec §3.1) on the dev split of target-greedy responses (or on ``batches``)."""
        import jax
        from flax import nnx

        from d3d_jax.training import objectives as obj
        from d3d_jax.training.data import batch_meta

        bs = self.cfg.block_size

        @nnx.jit
        def sums(m, batch):
            return obj.tau_from_logits(m(batch["tokens"], batch_meta(batch)), batch, bs)

        parts = [sums(model, {k: jax.numpy.asarray(v) for k, v in b.items()})
                 for b in (self.dev_batches() if batches is None else batches)]
        return obj.summarize_tau(obj.pool_tau_sums(parts))


