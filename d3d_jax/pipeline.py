"""The embedded default end to end (issue 8): tokenizer → target → small model → regeneration →
D3D drafters (+ ablations) → pruning → benchmark.  ``train/pipeline.py`` is its command line.

Every stage writes its output under ``PipelineConfig.out_dir`` (the shipped artifacts) and is
skipped when that output exists; scratch (training checkpoints, the tokenised pretraining
corpus) lives under ``work_dir`` (``runs/``, not shipped).  ``rebuild=True`` deletes the
artifacts first, so one command reproduces them from nothing.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import numpy as np

from d3d_jax import config as C
from d3d_jax import demo
from d3d_jax.io import tokenizer as tok_lib
from d3d_jax.io.chat import chat_prompt_ids


def _log(msg: str) -> None:
    print(f"[pipeline {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _write_json(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=float))
    tmp.replace(path)  # whole or not at all: a crashed stage is redone, never half-skipped


class Pipeline:
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
                    _log(f"--rebuild: removing {d}")
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

    # ---- helpers ------------------------------------------------------------------------------
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

    def _stage(self, name: str, done: bool, fn) -> None:
        if done:
            _log(f"stage {name}: output exists, skipped")
            return
        _log(f"stage {name}: running")
        t0 = time.time()
        fn()
        self.timings[name] = time.time() - t0
        _log(f"stage {name}: done in {self.timings[name]:.0f}s")

    def run(self, evaluate: bool = True) -> dict | None:
        c = self.cfg
        self._stage("1-tokenizer", (self.tokenizer_dir / "tokenizer.json").exists(), self.train_tokenizer)
        self._stage("2-pretrain-target", (self.model_dir("target") / "config.json").exists(),
                    lambda: self.pretrain("target", c.target))
        # The small model only seeds drafters; once they exist it is not needed (nor shipped).
        small_needed = any(v.init in ("small", "random") and not (self.drafter_dir(v.name) / "result.json").exists()
                           for v in c.drafters)
        self._stage("3-pretrain-small", (self.model_dir("small") / "config.json").exists() or not small_needed,
                    lambda: self.pretrain("small", c.small))
        # The training split is not shipped (6 MB): once every drafter exists only dev is needed.
        drafters_done = all((self.drafter_dir(v.name) / "result.json").exists() for v in c.drafters) and (
            not c.prune_drafter or (self.drafter_dir(f"{c.prune_drafter}_pruned") / "result.json").exists())
        self._stage("4-regenerate", self.regen_split("dev").exists()
                    and (self.regen_split("train").exists() or drafters_done), self.regenerate)
        for v in c.drafters:
            self._stage(f"5-drafter-{v.name}", (self.drafter_dir(v.name) / "result.json").exists(),
                        lambda v=v: self.train_drafter(v))
        if c.prune_drafter:
            name = f"{c.prune_drafter}_pruned"
            self._stage("6-prune", (self.drafter_dir(name) / "result.json").exists(), self.prune)
            self.unship_prune_source()
        if evaluate:
            from d3d_jax import pipeline_eval

            return pipeline_eval.benchmark(self)
        return None

    # ---- (1) tokenizer ------------------------------------------------------------------------
    def train_tokenizer(self) -> None:
        docs = tok_lib.load_corpus("pretrain", max_chars=self.cfg.tokenizer_chars)
        tok_lib.train_tokenizer(docs, self.cfg.vocab_size, self.tokenizer_dir)

    # ---- (2), (3) pretraining -----------------------------------------------------------------
    def pretrain_data(self) -> Path:
        path = self.work / "data" / "pretrain.jsonl"
        if path.exists():
            return path
        pairs = demo.continuation_pairs("pretrain", passage_chars=self.cfg.passage_chars,
                                        seed=self.cfg.seed, max_chars=self.cfg.pretrain_chars)
        tok = self.tokenizer()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for p in pairs:
                ids = chat_prompt_ids(tok, [{"role": "user", "content": p["prompt"]}])
                ids += tok(p["response"])["input_ids"]  # the LM loader appends <|im_end|>
                f.write(json.dumps({"token_ids": ids}) + "\n")
        tmp.replace(path)
        _log(f"pretraining corpus: {len(pairs)} continuation dialogues -> {path}")
        return path

    def _model_config(self, mc: C.ModelConfig, **extra) -> C.ModelConfig:
        ids = self.special_ids()  # trained in float32 whatever the stored dtype of an init model
        return dataclasses.replace(mc, vocab_size=len(self.tokenizer()), eos_token_id=ids["eos"],
                                   pad_token_id=ids["pad"], bos_token_id=None, param_dtype="float32",
                                   dtype="float32", **extra)

    @staticmethod
    def load(path: Path):
        """A shipped model for decoding or training: stored in bfloat16 or float32, run in float32
        (on a CPU, float32 matmuls are the fast ones, and the benchmark compares like with like)."""
        from d3d_jax.io.checkpoint import load_model

        return load_model(str(path), dtype="float32")

    def _train(self, name: str, model_cfg: C.ModelConfig, data: C.DataConfig, objective: C.ObjectiveConfig,
               optim: C.OptimConfig, steps: int, init_from: str = "", seed: int = 0, eval_every: int = 0):
        from d3d_jax.training import loop

        run_dir = self.work / "runs" / name
        cfg = C.TrainRunConfig(
            model=model_cfg, mesh=C.MeshConfig(data=1, fsdp=1, tensor=1), data=data, objective=objective,
            optim=optim, num_devices=1,
            train=C.TrainConfig(steps=steps, init_from=init_from, seed=seed, out_dir=str(run_dir),
                                log_every=25, eval_every=eval_every, checkpoint_every=0, keep_checkpoints=1,
                                async_checkpointing=False, resume=True, export_params=False,
                                export_hf=True, progress_bar=True, aot_compile=False))
        cfg.validate()
        trainer = loop.run(cfg, tokenizer=self.tokenizer())
        losses = [r["loss"] for r in trainer.history if "loss" in r] if hasattr(trainer, "history") else []
        return run_dir / "export" / "hf", losses

    def pretrain(self, name: str, stage: C.PretrainStageConfig) -> None:
        data = C.DataConfig(mode="lm", train_path=str(self.pretrain_data()), packed_length=stage.seq_len,
                            batch_size=stage.batch_size, seed=stage.seed, dev_batches=0,
                            pad_token_id=self.special_ids()["pad"])
        optim = C.OptimConfig(name="adamw", learning_rate=stage.learning_rate,
                              final_learning_rate=stage.learning_rate * 0.1, warmup_steps=stage.warmup_steps,
                              weight_decay=0.01)
        hf_dir, losses = self._train(f"pretrain_{name}", self._model_config(stage.model), data,
                                     C.ObjectiveConfig(kind="lm"), optim, stage.steps, seed=stage.seed)
        dest = self.model_dir(name)
        shutil.copytree(hf_dir, dest, dirs_exist_ok=True)
        if name == "target":
            self.store_compact(dest)  # shipped in bfloat16, run in float32 (Pipeline.load)
            self.ship_tokenizer(dest)
        _write_json({"steps": stage.steps, "final_loss": losses[-1] if losses else None,
                     "loss_every_25": losses[::25]}, dest / "pretrain_log.json")

    # ---- (4) regeneration ---------------------------------------------------------------------
    def regenerate(self) -> None:
        from d3d_jax.training import regenerate as regen

        c = self.cfg
        pairs = demo.continuation_pairs("prompts", passage_chars=c.passage_chars, seed=c.seed,
                                        max_pairs=c.regen_prompts)
        if len(pairs) < c.regen_prompts:  # top up from the pretraining split (never the eval split)
            pairs += demo.continuation_pairs("pretrain", passage_chars=c.passage_chars, seed=c.seed,
                                             max_pairs=c.regen_prompts - len(pairs),
                                             max_chars=c.pretrain_chars)
        prompts_path = self.out / "data" / "regen_prompts.jsonl"
        prompts_path.parent.mkdir(parents=True, exist_ok=True)
        with open(prompts_path, "w") as f:
            for i, p in enumerate(pairs):
                f.write(json.dumps({"id": f"{p['source']}-{i}",
                                    "messages": [{"role": "user", "content": p["prompt"]}]}) + "\n")
        target = self.load(self.model_dir("target"))
        settings = (regen.GenerationSettings.greedy(c.regen_max_new_tokens, c.seed) if c.regen_greedy
                    else regen.GenerationSettings(max_new_tokens=c.regen_max_new_tokens, seed=c.seed))
        summary = regen.regenerate(target, self.tokenizer(), prompts_path, self.regen_path, settings=settings,
                                   batch_size=c.regen_batch_size, target_path=str(self.model_dir("target")),
                                   max_prompt_tokens=min(512, target.config.max_position_embeddings
                                                         - c.regen_max_new_tokens))
        _log(f"regeneration: {summary}")
        records = [json.loads(x) for x in self.regen_path.read_text().splitlines() if x.strip()]
        records.sort(key=lambda r: r["id"])
        rng = np.random.default_rng(c.seed)
        order = rng.permutation(len(records))
        n_dev = max(8, len(records) // 10)
        for split, idx in (("train", order[n_dev:]), ("dev", order[:n_dev])):
            with open(self.regen_split(split), "w") as f:
                for i in sorted(idx):
                    f.write(json.dumps(records[i]) + "\n")

    # ---- (5) drafters -------------------------------------------------------------------------
    def drafter_data(self) -> C.DataConfig:
        c = self.cfg
        return C.DataConfig(mode="d3d", train_path=str(self.regen_split("train")),
                            dev_path=str(self.regen_split("dev")), tokenizer=str(self.tokenizer_dir),
                            packed_length=c.drafter_packed_length, num_anchors=c.drafter_num_anchors,
                            block_size=c.block_size, batch_size=c.drafter_batch_size, seed=c.seed,
                            dev_batches=2, mask_token_id=self.special_ids()["mask"],
                            pad_token_id=self.special_ids()["pad"])

    def train_drafter(self, v: C.DrafterVariantConfig) -> None:
        from d3d_jax.config import load_model_config

        c = self.cfg
        init_dir = {"small": self.model_dir("small"), "target": self.model_dir("target")}.get(v.init)
        base = load_model_config(str(init_dir or self.model_dir("small")))
        mc = self._model_config(base, mask_token_id=self.special_ids()["mask"], block_size=c.block_size)
        optim = C.OptimConfig(name="adamw", learning_rate=c.drafter_learning_rate,
                              final_learning_rate=c.drafter_learning_rate * 0.1, warmup_steps=20)
        objective = C.ObjectiveConfig(kind="d3d", gamma=c.drafter_gamma, ar_weight=v.ar_weight)
        steps = v.steps or c.drafter_steps
        hf_dir, losses = self._train(f"drafter_{v.name}", mc, self.drafter_data(), objective, optim, steps,
                                     init_from=str(init_dir) if init_dir else "", seed=c.seed,
                                     eval_every=max(25, steps // 12))  # the dev-loss curve
        dest = self.drafter_dir(v.name)
        shutil.copytree(hf_dir, dest, dirs_exist_ok=True)
        if v.name != c.prune_drafter:  # pruning trains on from the float32 weights
            self.store_compact(dest)
        tau = self.offline_tau(self.load(dest))  # of the weights as shipped
        _write_json({"variant": dataclasses.asdict(v), "steps": steps, "init_from": str(init_dir or "random"),
                     "final_loss": losses[-1] if losses else None, "offline_tau_dev": tau,
                     "curve": self.loss_curve(f"drafter_{v.name}")}, dest / "result.json")
        _log(f"drafter {v.name}: offline τ on dev = {tau['tau']:.3f}")

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

    def weights_dir(self, name: str) -> Path | None:
        """Where drafter ``name``'s weights are: shipped under out_dir, or kept under the work dir
        (:meth:`unship_prune_source`), or None (a fresh clone has only the shipped ones)."""
        for d in (self.drafter_dir(name), self.work / "drafters" / name):
            if (d / "model.safetensors").exists():
                return d
        return None

    def unship_prune_source(self) -> None:
        """The drafter pruning started from is as large as the target: once its pruned version
        exists, its weights move to the work dir (its config and result stay in out_dir)."""
        c = self.cfg
        src = self.drafter_dir(c.prune_drafter)
        if c.prune_drafter in c.eval_drafters or not (src / "model.safetensors").exists():
            return
        keep = self.work / "drafters" / c.prune_drafter
        keep.mkdir(parents=True, exist_ok=True)
        shutil.move(str(src / "model.safetensors"), str(keep / "model.safetensors"))
        for f in src.iterdir():
            if f.is_file():
                shutil.copy2(f, keep / f.name)
        _log(f"{c.prune_drafter}: weights moved to {keep} (not shipped; its pruned version is)")

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

    def dev_batches(self, **data_changes) -> list[dict]:
        from d3d_jax.training import data as data_lib

        dc = dataclasses.replace(self.drafter_data(), **data_changes)
        ds, _ = data_lib.build_dataset(dc, dc.dev_path, tokenizer=self.tokenizer(),
                                       mask_token_id=dc.mask_token_id, seed=dc.seed + 12345, shuffle=False)
        n = max(1, min(8, len(ds) if hasattr(ds, "__len__") else 8))
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

    # ---- (6) pruning --------------------------------------------------------------------------
    def prune(self) -> None:
        from d3d_jax import pipeline_eval

        pipeline_eval.prune(self)
