"""Acceptance-guided progressive layer pruning of the drafter (spec §3).

One round: score every remaining layer by the drafter's acceptance length τ with that layer
removed, delete the layer whose removal costs least, then recover by distilling from the fixed
*unpruned* teacher with η-adjusted targets ``q̃ = (1-η)·q + η·e_y`` (the smallest η giving the
supervised token a margin ``m``), plus ``λ·L_AR``.  ShortGPT's criterion (a layer whose output
is most similar to its input matters least) is the comparison rule.

The pieces are importable on their own: :func:`margin_eta` / :func:`adjusted_teacher` (§3.3),
:class:`OfflineTau` (§3.1, batched + jitted, one compile per depth because every candidate of
one depth has the same graph), :func:`trajectory_tau` (replays greedy speculative decoding's
rounds from per-anchor acceptance: equals the engine's τ), :func:`online_tau` (the engine
itself), :func:`acceptance_importance` / :func:`shortgpt_importance` (§3.1-2),
:func:`make_distillation_loss` + :func:`trainer_recovery` (§3.3, a custom loss for the training
loop's :class:`~d3d_jax.training.loop.Trainer`) and :func:`prune_progressively` (§3.4: the
pruning rule's line of descent, and the comparison rule's own beside it).  The program over a
config and its report are :mod:`d3d_jax.training.prune_run`.

Batches are the packed rows of :mod:`d3d_jax.training.data` (``[clean S | n blocks]`` with
``labels``, ``slot``, ``ar_mask``, ``anchor_valid``); :func:`pack_dev_rows` builds such rows
for arbitrary anchors (the prompt's last token, blocks running past the end) so offline τ can
follow the engine's anchoring exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from d3d_jax.model.masks import packed_training_meta
from d3d_jax.model.qwen3 import Qwen3, remove_layers
from d3d_jax.training import data as data_lib
from d3d_jax.training import objectives as obj

# --------------------------------------------------------------------------------------
# η-adjusted teacher (spec §3.3)
# --------------------------------------------------------------------------------------


def _target_and_runner_up(q_v: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    q_y = jnp.take_along_axis(q_v, y[..., None], axis=-1)[..., 0]
    is_y = jax.nn.one_hot(y, q_v.shape[-1], dtype=bool)
    q_max_other = jnp.max(jnp.where(is_y, -jnp.inf, q_v), axis=-1)
    return q_y, q_max_other


def margin_eta(q_v: jax.Array, y: jax.Array, margin: float | jax.Array) -> jax.Array:
    """Smallest η ∈ [0, 1] with ``q̃_y ≥ max_{v≠y} q̃_v + margin`` for ``q̃ = (1-η)q + η e_y``.

    Mixing in ``e_y`` scales every other entry by (1-η), so the runner-up stays the runner-up
    and the gap grows linearly: ``gap(η) = g + η(1 - g)`` with ``g = q_y - q_max_other``.  When
    ``g = 1`` (q is already one-hot on y) the denominator is 0 and η = 0 already suffices
    for any margin ≤ 1; a margin > 1 is unreachable and gives η = 1.
    """
    q_y, q_other = _target_and_runner_up(q_v.astype(jnp.float32), y)
    gap = q_y - q_other
    denom = 1.0 - gap
    safe = jnp.where(denom > 0, denom, 1.0)
    eta = jnp.clip((margin - gap) / safe, 0.0, 1.0)
    return jnp.where(denom > 0, eta, jnp.where(gap >= margin, 0.0, 1.0))


def adjusted_teacher(q_v: jax.Array, y: jax.Array, margin: float | jax.Array) -> jax.Array:
    """``q̃ = (1-η)·q + η·e_y`` with η from :func:`margin_eta` (vectorised over leading axes)."""
    q_v = q_v.astype(jnp.float32)
    eta = margin_eta(q_v, y, margin)[..., None]
    return (1.0 - eta) * q_v + eta * jax.nn.one_hot(y, q_v.shape[-1], dtype=jnp.float32)


# --------------------------------------------------------------------------------------
# Dev rows anchored anywhere (the engine's anchoring, for trajectory replay)
# --------------------------------------------------------------------------------------


def pack_dev_rows(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                  anchors: Sequence[Sequence[int]], block_size: int, mask_token_id: int,
                  clean_len: int, pad_token_id: int = 0) -> dict[str, np.ndarray]:
    """Packed rows in :mod:`d3d_jax.training.data`'s format for *arbitrary* anchors (numpy).

    Unlike training rows (full blocks inside the response), a block may start at the prompt's
    last token (where decoding's first block sits) and run past the end: slots beyond the
    sequence get label -1 and slot -1, so they never count as accepted and carry no loss.
    Every row gets ``n = max(len(anchors))`` blocks; missing ones are invalid.
    """
    n = max(1, max(len(a) for a in anchors))
    rows, T, B = len(sequences), clean_len + n * block_size, block_size
    out = {k: np.zeros((rows, T), np.int32) for k in ("tokens", "positions", "block_ids", "context_end")}
    out["tokens"][:] = pad_token_id
    out["valid"] = np.zeros((rows, T), bool)
    out["labels"] = np.full((rows, T), -1, np.int32)
    out["ar_mask"] = np.zeros((rows, T), bool)
    out["slot"] = np.full((rows, T), -1, np.int32)
    out["anchors"] = np.zeros((rows, n), np.int32)
    out["anchor_valid"] = np.zeros((rows, n), bool)
    for r, (seq, p_len, anc) in enumerate(zip(sequences, prompt_lens, anchors)):
        seq = np.asarray(seq, np.int32)
        L = len(seq)
        if L > clean_len:
            raise ValueError(f"pack_dev_rows: sequence {r} has {L} tokens > clean_len={clean_len}")
        anc = np.asarray(anc, np.int32)
        if anc.size and (anc.min() < 0 or anc.max() >= L - 1):
            raise ValueError(f"pack_dev_rows: anchors of sequence {r} must lie in [0, {L - 1})")
        out["anchors"][r, :anc.size] = anc
        out["anchor_valid"][r, :anc.size] = True
        meta = packed_training_meta(clean_len, out["anchors"][r], B, T, clean_valid_len=L,
                                    anchor_valid=out["anchor_valid"][r])
        for k in ("positions", "block_ids", "context_end", "valid"):
            out[k][r] = meta[k]
        out["tokens"][r, :L] = seq
        out["labels"][r, :L - 1] = seq[1:]
        out["ar_mask"][r, max(p_len - 1, 0):L - 1] = True
        for b, a in enumerate(anc):
            start = clean_len + b * B
            out["tokens"][r, start:start + B] = mask_token_id
            out["tokens"][r, start] = seq[a]
            k = np.arange(B)[a + np.arange(B) < L]
            out["labels"][r, start + k] = seq[a + k]
            out["slot"][r, start + k] = k
    return out


def _device_batch(batch: dict) -> dict:
    return {k: jnp.asarray(v) for k, v in batch.items()}


# --------------------------------------------------------------------------------------
# Offline τ (spec §3.1)
# --------------------------------------------------------------------------------------


def accepted_lengths(logits_btv: jax.Array, batch: dict, block_size: int) -> jax.Array:
    """Per block ``[b, n]``: leading slots 1..B-1 whose argmax equals the label.

    That is what greedy verification accepts when the labels are the target's greedy output.
    """
    n = batch["anchor_valid"].shape[-1]
    pred = obj.block_view(jnp.argmax(logits_btv, axis=-1), n, block_size)
    hit = pred == obj.block_view(batch["labels"], n, block_size)
    return jnp.sum(jnp.cumprod(hit[..., 1:].astype(jnp.int32), axis=-1), axis=-1)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _tau_core(graphdef, state, batch, block_size):
    logits = nnx.merge(graphdef, state)(batch["tokens"], data_lib.batch_meta(batch))
    return obj.tau_from_logits(logits, batch, block_size), accepted_lengths(logits, batch, block_size)


def model_tau_sums(model: Qwen3, batch: dict, block_size: int) -> tuple[dict, np.ndarray]:
    """Jitted: (the objectives' pooled τ sums, accepted per block ``[b, n]``) of one batch.

    One compile per (graph, batch shape): every candidate of one depth has the same graph.
    """
    graphdef, state = nnx.split(model)
    sums, acc = _tau_core(graphdef, state, _device_batch(batch), int(block_size))
    return jax.device_get(sums), np.asarray(acc)


class OfflineTau:
    """Offline τ of a drafter on fixed dev batches, pooled exactly over every valid anchor."""

    def __init__(self, dev_batches: Sequence[dict], block_size: int):
        if not dev_batches:
            raise ValueError("OfflineTau: the dev set is empty (set data.dev_path / data.dev_batches)")
        if not any(np.any(b["anchor_valid"]) for b in dev_batches):
            raise ValueError("OfflineTau: the dev set has no valid anchor (responses shorter than a block?)")
        self.dev_batches, self.block_size = list(dev_batches), int(block_size)

    def details(self, model: Qwen3) -> dict:
        """``{"tau", "slot_accuracy", "tau_hist", "anchors"}``."""
        sums = [model_tau_sums(model, b, self.block_size)[0] for b in self.dev_batches]
        return obj.summarize_tau(obj.pool_tau_sums(sums))

    def __call__(self, model: Qwen3) -> float:
        return self.details(model)["tau"]


def trajectory_tau(accepted_by_anchor: Sequence[np.ndarray], first_anchor: Sequence[int],
                   stop_pos: Sequence[int]) -> tuple[float, int]:
    """τ that greedy speculative decoding measures, replayed from per-anchor acceptance.

    ``accepted_by_anchor[i][p]``: accept count of the block anchored at position p of sequence
    i.  Decoding starts at the prompt's last token; a round accepting a drafts commits a + 1
    tokens and the next anchor is the last committed token.  Rounds run while the anchor is
    before ``stop_pos[i]`` (prompt_len - 1 + max_new_tokens).  Like the engine, the last round
    counts its full a + 1 even where the output is cut, so for exact agreement the responses
    must extend a block past ``stop_pos``.  Returns (Σ(a+1) / rounds, rounds).
    """
    total = rounds = 0
    for acc, pos, stop in zip(accepted_by_anchor, first_anchor, stop_pos):
        pos = int(pos)
        while pos < stop:
            step = int(acc[pos]) + 1
            total, rounds, pos = total + step, rounds + 1, pos + step
    return total / max(rounds, 1), rounds


def online_tau(drafter: Qwen3, target: Qwen3, prompts: Sequence[Sequence[int]], *,
               max_new_tokens: int, block_size: int, mask_token_id: int | None = None,
               eos_token_ids: Sequence[int] = (), batch_size: int | None = None) -> float:
    """τ over all rounds of real greedy speculative decoding (engine, sync mode): the slow option."""
    from d3d_jax.decoding import engine
    from d3d_jax.decoding.metrics import summarize

    prompts = [list(p) for p in prompts]
    target, drafter = engine.decoding_layout(target), engine.decoding_layout(drafter)
    dec = engine.make_decoder(target, drafter, mode="sync", num_slots=batch_size or len(prompts),
                              max_cache_len=engine.cache_len_for(prompts, max_new_tokens, block_size),
                              block_size=block_size, mask_token_id=mask_token_id)
    outs = engine.generate(dec, prompts, max_new_tokens=max_new_tokens,
                           eos_token_ids=tuple(eos_token_ids))
    return float(summarize([o.metrics for o in outs])["tau"])


# --------------------------------------------------------------------------------------
# Layer importance (spec §3.1-2) and the ShortGPT comparison rule
# --------------------------------------------------------------------------------------


def acceptance_importance(model: Qwen3, tau_fn: Callable[[Qwen3], float],
                          progress: bool = False) -> list[float]:
    """τ with each layer removed; the layer with the highest τ is the least important."""
    n = model.config.num_layers
    layers: Iterable[int] = range(n)
    if progress:
        from tqdm import tqdm
        layers = tqdm(layers, desc=f"importance @ depth {n}", leave=False)
    return [float(tau_fn(remove_layers(model, [l]))) for l in layers]


@functools.partial(jax.jit, static_argnums=(0,))
def _layer_similarity_core(graphdef, state, batch):
    model = nnx.merge(graphdef, state)
    _, hidden = model(batch["tokens"], data_lib.batch_meta(batch), return_hidden_states=True)
    h = jnp.stack(hidden).astype(jnp.float32)  # [L+1, b, t, d]
    a, b = h[:-1], h[1:]
    cos = jnp.sum(a * b, -1) / (jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1) + 1e-12)
    valid = jnp.asarray(batch["valid"], jnp.float32)
    return jnp.sum(cos * valid, axis=(1, 2)), jnp.sum(valid)


def shortgpt_importance(model: Qwen3, dev_batches: Sequence[dict]) -> list[float]:
    """ShortGPT's Block Influence ``1 - E[cos(h_in, h_out)]`` per layer over valid tokens."""
    graphdef, state = nnx.split(model)
    sims, count = 0.0, 0.0
    for batch in dev_batches:
        s, c = _layer_similarity_core(graphdef, state, _device_batch(batch))
        sims, count = sims + np.asarray(s, np.float64), count + float(c)
    return [float(1.0 - x) for x in sims / max(count, 1.0)]


def least_important(criterion: str, scores: Sequence[float]) -> int:
    """Layer to delete: max τ-without-it (acceptance) or min Block Influence (shortgpt)."""
    if criterion == "acceptance":
        return int(np.argmax(scores))
    if criterion == "shortgpt":
        return int(np.argmin(scores))
    raise ValueError(f"criterion: expected 'acceptance' or 'shortgpt', got {criterion!r}")


# --------------------------------------------------------------------------------------
# Recovery: η-adjusted distillation from the fixed unpruned teacher (spec §3.3)
# --------------------------------------------------------------------------------------


def distillation_loss_from_logits(student_logits: jax.Array, teacher_logits: jax.Array, batch: dict, *,
                                  margin: float, gamma: float, ar_weight: float,
                                  block_tokens: int | None = None) -> tuple[jax.Array, dict]:
    """``Σ w_k·CE(q̃_k, student_k) / Σ w_k`` over block slots (the objectives' ``w_k`` and
    normalisation) ``+ λ·L_AR`` (hard next-token CE on the clean stream's response tokens).

    ``block_tokens`` (``num_anchors·block_size``): the soft targets are only built for the block
    region, the row's last ``block_tokens`` positions — at 151k vocabulary, the q / q̃ / log-prob
    arrays of the clean stream would otherwise cost as much again as the logits.
    """
    y = jnp.maximum(batch["labels"], 0)
    l_ar, n_ar = obj.ar_loss(obj.token_cross_entropy(student_logits, y), batch)
    cut = slice(None) if block_tokens is None else slice(student_logits.shape[1] - block_tokens, None)
    q = jax.nn.softmax(teacher_logits[:, cut].astype(jnp.float32), axis=-1)
    q_tilde = jax.lax.stop_gradient(adjusted_teacher(q, y[:, cut], margin))
    logp = jax.nn.log_softmax(student_logits[:, cut].astype(jnp.float32), axis=-1)
    soft_ce = -jnp.sum(q_tilde * logp, axis=-1)
    l_diff, wsum = obj.weighted_block_loss(soft_ce, {**batch, "slot": batch["slot"][:, cut]}, gamma)
    loss = l_diff + ar_weight * l_ar
    return loss, {"loss": loss, "loss_diff": l_diff, "loss_ar": l_ar, "diff_weight_sum": wsum,
                  "ar_tokens": n_ar}


def make_distillation_loss(teacher_graphdef: Any, *, margin: float, gamma: float, ar_weight: float,
                           block_tokens: int | None = None) -> Callable:
    """``loss_fn(model, batch, teacher_state)`` for :class:`d3d_jax.training.loop.Trainer`
    (``loss_extra=teacher_state``: the frozen teacher travels as a jit argument)."""

    def loss_fn(model, batch, teacher_state):
        meta = data_lib.batch_meta(batch)
        teacher_logits = jax.lax.stop_gradient(
            nnx.merge(teacher_graphdef, teacher_state)(batch["tokens"], meta))
        return distillation_loss_from_logits(model(batch["tokens"], meta), teacher_logits, batch,
                                             margin=margin, gamma=gamma, ar_weight=ar_weight,
                                             block_tokens=block_tokens)

    return loss_fn


def trainer_recovery(run_cfg: Any, teacher: Qwen3, train_data: Any, out_dir: str | Path, *,
                     margin: float, export: bool = True, log: Callable[[str], None] | None = None,
                     dev_batches: Sequence[dict] = ()) -> Callable[[Qwen3, str], Qwen3]:
    """``recover(student, name) -> student``: ``run_cfg.train.steps`` steps of the training loop
    (:class:`~d3d_jax.training.loop.Trainer`) with the distillation loss; its Orbax train-state
    checkpoint, param checkpoint and HF export go to ``out_dir/name`` (exports when ``export``).
    ``run_cfg`` is a :class:`~d3d_jax.config.TrainRunConfig` whose model section is replaced by
    the student's config each call.  With ``dev_batches`` and ``train.eval_every``, the student's
    offline τ every ``eval_every`` steps lands in ``out_dir/name/metrics.jsonl``: the recovery
    curve that shows whether the budget was long enough."""
    from d3d_jax.training.loop import Trainer

    tgraph, tstate = nnx.split(teacher)
    loss_fn = make_distillation_loss(tgraph, margin=margin, gamma=run_cfg.objective.gamma,
                                     ar_weight=run_cfg.objective.ar_weight,
                                     block_tokens=run_cfg.data.num_anchors * run_cfg.data.block_size)

    def recover(student: Qwen3, name: str) -> Qwen3:
        tc = dataclasses.replace(run_cfg.train, out_dir=str(Path(out_dir) / name), init_from="",
                                 export_params=export and run_cfg.train.export_params,
                                 export_hf=export and run_cfg.train.export_hf)
        cfg = dataclasses.replace(run_cfg, model=student.config, train=tc)
        cfg.validate()
        trainer = Trainer(cfg, model=student, loss_fn=loss_fn, loss_extra=tstate,
                          train_data=train_data, dev_batches=list(dev_batches), log=log)
        try:
            trainer.fit()
            if tc.export_params or tc.export_hf:
                trainer.export()
            return trainer.model()
        finally:
            trainer.close()

    return recover


# --------------------------------------------------------------------------------------
# Progressive pruning (spec §3.4)
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Chain:
    """One line of descent: the current (recovered) model, which original layers it holds, its τ."""

    model: Qwen3
    original_layers: list[int]
    tau: float

    def cut(self, layer: int) -> tuple[Qwen3, list[int]]:
        kept = list(self.original_layers)
        kept.pop(layer)
        return remove_layers(self.model, [layer]), kept


def layer_scores(model: Qwen3, tau_fn: Callable[[Qwen3], float], similarity_batches: Sequence[dict],
                 rules: Sequence[str], progress: bool = False) -> dict[str, list[float]]:
    """Per rule in ``rules``, a score per layer: τ without it (acceptance), Block Influence (shortgpt)."""
    out = {}
    if "acceptance" in rules:
        out["acceptance"] = acceptance_importance(model, tau_fn, progress=progress)
    if "shortgpt" in rules:
        out["shortgpt"] = shortgpt_importance(model, similarity_batches)
    return out


def _prune_round(chain: Chain, layer: int, tau_pruned: float, recover: Callable[[Qwen3, str], Qwen3],
                 tau_fn: Callable[[Qwen3], float], name: str, tau0: float) -> tuple[Chain, dict]:
    """Delete ``layer`` from the chain's model, recover, measure: the next chain and the facts."""
    student, kept = chain.cut(layer)
    t = time.perf_counter()
    recovered = recover(student, name)
    recovery_s = time.perf_counter() - t
    tau = float(tau_fn(recovered))
    return Chain(recovered, kept, tau), {
        "layer": layer, "original_layer": chain.original_layers[layer], "tau_pruned": tau_pruned,
        "tau_recovered": tau, "retention": tau / tau0, "recovery_s": recovery_s,
        "remaining_original_layers": kept}


def _other_rule_round(alt: Chain, main: Chain, main_next: Chain, main_facts: dict, scores: dict,
                      rule: str, steps: "_RoundSteps", name: str) -> tuple[Chain, dict]:
    """The comparison rule's own line of descent, one round: the same depth, the same recovery
    budget.  While both rules have picked the same layers the lines coincide and share work."""
    if alt is main:  # the other rule's pick from the same parent
        rule_scores = scores[rule]
        layer = least_important(rule, rule_scores)
        if layer == main_facts["layer"]:
            return main_next, {"rule": rule, "shared": True, **main_facts, "recovery_s": 0.0}
        tau_pruned = scores["acceptance"][layer]
    else:
        rule_scores = layer_scores(alt.model, steps.tau_fn, steps.similarity_batches, [rule])[rule]
        layer = least_important(rule, rule_scores)
        tau_pruned = rule_scores[layer] if rule == "acceptance" else float(steps.tau_fn(alt.cut(layer)[0]))
    nxt, facts = _prune_round(alt, layer, tau_pruned, steps.recover, steps.tau_fn, f"{name}_{rule}", steps.tau0)
    return nxt, {"rule": rule, "shared": False, "scores": rule_scores, **facts}


@dataclasses.dataclass(frozen=True)
class _RoundSteps:
    tau_fn: Callable[[Qwen3], float]
    similarity_batches: Sequence[dict]
    recover: Callable[[Qwen3, str], Qwen3]
    tau0: float


def prune_progressively(drafter: Qwen3, *, tau_fn: Callable[[Qwen3], float],
                        similarity_batches: Sequence[dict],
                        recover: Callable[[Qwen3, str], Qwen3], target_layers: int,
                        retention_floor: float = 0.0, criterion: str = "acceptance",
                        compare_shortgpt: bool = False,
                        on_round: Callable[[int, Qwen3, dict], None] | None = None,
                        progress: bool = False) -> tuple[Qwen3, dict]:
    """Delete one layer per round until ``target_layers`` or τ < ``retention_floor·τ₀``.

    ``recover(student, name)`` distils the pruned student (from the fixed unpruned teacher,
    :func:`trainer_recovery`); ``name`` is ``round_XX`` or ``round_XX_<other rule>``.  Every
    round scores the layers by both rules (τ without each layer; ShortGPT's Block Influence).
    With ``compare_shortgpt`` the other rule prunes its own line of descent too, its pick of the
    layers at every depth with the same recovery per round, so both rules are compared at equal
    depth and budget (``rule_comparison``).  Returns the last model whose recovered τ met the
    floor, and the report.
    """
    least_important(criterion, [0.0])  # a bad name fails before any work
    if not 1 <= target_layers <= drafter.config.num_layers:
        raise ValueError(f"target_layers={target_layers} must be in [1, {drafter.config.num_layers}]")
    other_rule = "shortgpt" if criterion == "acceptance" else "acceptance"
    t0 = time.perf_counter()
    tau0 = float(tau_fn(drafter))
    report: dict[str, Any] = {"criterion": criterion, "initial_depth": drafter.config.num_layers,
                              "initial_tau": tau0, "target_layers": target_layers,
                              "retention_floor": retention_floor, "rounds": [],
                              "stopped": "target depth reached"}
    main = Chain(drafter, list(range(drafter.config.num_layers)), tau0)
    alt, best = main, drafter
    while main.model.config.num_layers > target_layers:
        start, n = time.perf_counter(), len(report["rounds"]) + 1
        scores = layer_scores(main.model, tau_fn, similarity_batches, PRUNE_RULES, progress)
        layer = least_important(criterion, scores[criterion])
        nxt, facts = _prune_round(main, layer, scores["acceptance"][layer], recover, tau_fn,
                                  f"round_{n:02d}", tau0)
        rec = _round_record(n, main, nxt, facts, scores, other_rule)
        if compare_shortgpt:
            steps = _RoundSteps(tau_fn, similarity_batches, recover, tau0)
            alt, other = _other_rule_round(alt, main, nxt, facts, scores, other_rule, steps, f"round_{n:02d}")
            rec["other_rule"].update(other)
        rec["wall_s"] = time.perf_counter() - start
        report["rounds"].append(rec)
        main = nxt
        if on_round is not None:
            on_round(n, main.model, rec)
        if main.tau < retention_floor * tau0:
            report["stopped"] = (f"τ {main.tau:.4f} fell below the retention floor "
                                 f"{retention_floor}·{tau0:.4f}")
            break
        best = main.model
    report["final_depth"] = best.config.num_layers
    report["rule_comparison"] = [_comparison_row(r, criterion, other_rule) for r in report["rounds"]]
    report["wall_s"] = time.perf_counter() - t0
    return best, report


PRUNE_RULES = ("acceptance", "shortgpt")


def _round_record(n: int, parent: Chain, nxt: Chain, facts: dict, scores: dict, other_rule: str) -> dict:
    """A round's facts in the report's field names; ``other_rule`` starts as the other rule's pick
    from the same parent (before any recovery of its own)."""
    other = least_important(other_rule, scores[other_rule])
    return {"round": n, "depth_before": len(parent.original_layers), "depth_after": len(nxt.original_layers),
            "tau_before_pruning": parent.tau, "tau_without_layer": scores["acceptance"],
            "shortgpt_block_influence": scores["shortgpt"], "removed_layer": facts["layer"],
            "removed_original_layer": facts["original_layer"], "tau_pruned": facts["tau_pruned"],
            "tau_recovered": facts["tau_recovered"], "retention": facts["retention"],
            "recovery_s": facts["recovery_s"], "remaining_original_layers": facts["remaining_original_layers"],
            "other_rule": {"rule": other_rule, "layer": other,
                           "original_layer": parent.original_layers[other],
                           "tau_pruned": scores["acceptance"][other]}}


def _comparison_row(r: dict, criterion: str, other_rule: str) -> dict:
    o = r["other_rule"]
    return {"depth": r["depth_after"], f"{criterion}_layer": r["removed_original_layer"],
            f"{other_rule}_layer": o["original_layer"], f"{criterion}_tau_pruned": r["tau_pruned"],
            f"{other_rule}_tau_pruned": o["tau_pruned"], f"{criterion}_tau_recovered": r["tau_recovered"],
            f"{other_rule}_tau_recovered": o.get("tau_recovered"),
            f"{criterion}_layers": r["remaining_original_layers"],
            f"{other_rule}_layers": o.get("remaining_original_layers")}
