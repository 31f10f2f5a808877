"""Target-aligned data regeneration (spec §2.1): the target rewrites every response.

Pipeline: read prompt lines in the common chat formats -> keep the user side -> render with the
target's chat template (generation prompt; thinking disabled unless ``enable_thinking``) -> the
engine's plain sampling, batched continuously -> one JSONL record per prompt, appended and fsynced so that an
interrupted run resumes exactly where it stopped.

Choices worth knowing (prompt formats, the user side and ids: :mod:`d3d_jax.io.chat`):

* **Continuous batching**: every prompt of the shard not yet done is queued (by length, then
  id) into one plain decoder of ``batch_size`` rows; its on-device loop runs until a few rows
  finish, their records are appended, and the next prompts take those rows
  (:func:`d3d_jax.decoding.engine.generate_stream`), so no row idles behind a batch's longest
  response.
* **Determinism**: each row samples from its own key derived from ``(seed, id)`` and the
  position, never from its row or neighbours, so a resumed run writes the records an
  uninterrupted one would (in float32; a bfloat16 target's matmuls round differently with the
  batch's shape, docs/results/data.md).
* **Shards**: prompt ``id`` goes to process ``sha256(id) mod process_count`` (stable when the
  prompt file grows); each process writes its own file ``<stem>-<i>-of-<n><suffix>``, and
  :func:`merge_shards` joins them into the one file the training data pipeline reads.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from d3d_jax.errors import DataError, ModelFileError, RecordError, UsageError
from d3d_jax.io import records as rec_lib
from d3d_jax.io.files import read_json
from d3d_jax.io.chat import (  # noqa: F401  (re-exported: the regeneration API)
    MalformedPrompt, Prompt, content_id, read_prompts, render_prompt, user_side)
from d3d_jax.training.regen_output import (  # noqa: F401  (re-exported: the regeneration API)
    RESUME_FIELDS, append_records, check_compatible, merge_shards, record_problem, recover_output, set_aside,
    shard_output_path)
from d3d_jax.training.regen_identity import stop_token_ids, target_identity, template_identity

QWEN3_NON_THINKING = dict(temperature=0.7, top_p=0.8, top_k=20)
ENGINE_BLOCK_SLACK = 16  # engine.generate reserves block_size (default 16) cache slots, even for plain


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    """What a record says about how it was sampled (greedy: temperature 0, top_p 1, top_k 0)."""

    temperature: float = QWEN3_NON_THINKING["temperature"]
    top_p: float = QWEN3_NON_THINKING["top_p"]
    top_k: int = QWEN3_NON_THINKING["top_k"]
    max_new_tokens: int = 512
    seed: int = 0

    @classmethod
    def greedy(cls, max_new_tokens: int = 512, seed: int = 0) -> "GenerationSettings":
        return cls(0.0, 1.0, 0, max_new_tokens, seed)

    def validate(self) -> None:
        if self.temperature < 0:
            raise UsageError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UsageError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def compute_dtype(dtype: str | None, platform: str) -> str | None:
    """The dtype the target decodes in: ``dtype`` if set, else float32 on a CPU and the stored one
    elsewhere.  XLA:CPU has no bfloat16 arithmetic: it converts operands to float32 around each
    op, and a bfloat16 KV cache is converted whole, both ways, to write each round's token
    (docs/results/data.md).  Float32 records are also independent of the batch's shape."""
    if dtype is not None:
        return dtype
    return "float32" if platform == "cpu" else None


def settings_from_config(cfg, target_dir: str | os.PathLike | None = None) -> GenerationSettings:
    """The record's sampling settings from a :class:`d3d_jax.config.RegenerateConfig`; a setting
    left unset comes from ``target_dir``'s ``generation_config.json`` (:func:`target_sampling`)."""
    if cfg.greedy:
        return GenerationSettings.greedy(cfg.max_new_tokens, cfg.seed)
    own = target_sampling(target_dir)
    pick = lambda key, value: own[key] if value is None else value  # noqa: E731
    return GenerationSettings(pick("temperature", cfg.temperature), pick("top_p", cfg.top_p),
                              pick("top_k", cfg.top_k), cfg.max_new_tokens, cfg.seed)


def target_sampling(target_dir: str | os.PathLike | None) -> dict:
    """``temperature / top_p / top_k`` from the target's ``generation_config.json`` (its authors'
    defaults, what vLLM samples with too); each one it lacks is Qwen3's non-thinking value.
    ``do_sample: false`` there means greedy."""
    path = Path(target_dir) / "generation_config.json" if target_dir else None
    if path is None or not path.is_file():
        return dict(QWEN3_NON_THINKING)
    own = read_json(path, "generation_config.json")  # a regular file, numbers bounded before parsing
    if not isinstance(own, dict):
        raise ModelFileError(f"{path}: not a JSON object")
    if own.get("do_sample") is False:
        return dict(temperature=0.0, top_p=1.0, top_k=0)
    out = {k: own.get(k, v) for k, v in QWEN3_NON_THINKING.items()}
    GenerationSettings(out["temperature"], out["top_p"], out["top_k"]).validate()
    return out


# --------------------------------------------------------------------------------------------
# Sharding, bucketing, seeds
# --------------------------------------------------------------------------------------------
def _hash_int(text: str, nbytes: int = 8) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:nbytes], "big")


def shard_index(prompt_id: str, process_count: int) -> int:
    """Which process owns ``prompt_id``: a stable hash, independent of the other prompts."""
    return _hash_int(prompt_id) % process_count


def shard_prompts(prompts: Sequence[Prompt], process_index: int, process_count: int) -> list[Prompt]:
    if process_count < 1:
        raise UsageError(f"process_count must be >= 1, got {process_count}")
    if not 0 <= process_index < process_count:
        raise UsageError(f"process_index must be in [0, {process_count}), got {process_index}")
    return [p for p in prompts if shard_index(p.id, process_count) == process_index]


def record_seed(seed: int, prompt_id: str) -> int:
    """A row's sampling seed from the run seed and the prompt id only (never batch position)."""
    return _hash_int(f"{seed}\x00{prompt_id}", 4) & 0x7FFFFFFF


def plan_batches(ids: Sequence[str], lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar prompt length (sorted by length, then id)."""
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(ids)), key=lambda i: (lengths[i], ids[i]))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def padding_waste(lengths: Sequence[int], cache_len: int, widths: Sequence[int] = ()) -> float:
    """Fraction of prefilled prompt positions that are padding: each prompt is prefilled alone,
    padded to the first of ``widths`` that holds it (default: its length bucket,
    :func:`~d3d_jax.config.decoding.prompt_bucket`)."""
    from d3d_jax.config.decoding import prompt_bucket

    widths = sorted(widths)
    padded = sum(next((w for w in widths if w >= n), None) or prompt_bucket(n, cache_len) for n in lengths)
    return 1.0 - sum(lengths) / padded if padded else 0.0


# One more admission program costs about as much as prefilling this many padded prompt tokens
# (the demo target on XLA:CPU: 2.1-2.7 s to compile, 0.28 ms a prefilled token)
PROGRAM_TOKENS = 8192


def prompt_widths(lengths: Sequence[int], multiple: int = 64, program_tokens: int = PROGRAM_TOKENS
                  ) -> tuple[int, ...]:
    """The prompt widths (multiples of ``multiple``) admission pads this run's prompts to: the
    fewest programs for the padding, each program counted as ``program_tokens`` padded tokens
    (an exact minimum over the lengths, sorted; a few dozen prompts get one or two widths)."""
    if not lengths:
        return ()
    counts = collections.Counter(_round_up(max(int(n), 1), multiple) for n in lengths)
    cands = sorted(counts)
    # best[i]: the cost of the prompts up to width cands[i-1] with a program at that width
    best, cut = [0.0] + [float("inf")] * len(cands), [0] * (len(cands) + 1)
    for i in range(1, len(cands) + 1):
        held = 0
        for j in range(i - 1, -1, -1):  # widths cands[j..i-1] all padded to cands[i-1]
            held += counts[cands[j]]
            cost = best[j] + program_tokens + held * cands[i - 1]
            if cost < best[i]:
                best[i], cut[i] = cost, j
    out, i = [], len(cands)
    while i > 0:
        out.append(cands[i - 1])
        i = cut[i]
    return tuple(sorted(out))


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class RegenerationSummary:
    output: str
    prompt_lines: int = 0  # usable prompts in the whole file
    shard_prompts: int = 0  # of those, owned by this process
    already_done: int = 0  # found in the output file at start
    written: int = 0  # appended by this run
    generated_tokens: int = 0
    seconds: float = 0.0  # wall clock of the generation loop
    cpu_seconds: float = 0.0  # this process's CPU time in it (steadier on a shared host)
    padding_waste: float = 0.0
    malformed: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    skipped: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # usable JSON, unusable here
    # output lines that could not count as done: set aside (<out>.invalid) and regenerated
    invalid_records: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def complete(self) -> bool:
        return self.already_done + self.written + len(self.skipped) >= self.shard_prompts

    def format(self, max_listed: int = 50) -> str:
        lines = [f"output {self.output}: {self.already_done} records already there, {self.written} written "
                 f"now, {self.shard_prompts} prompts in this shard of {self.prompt_lines}"
                 + ("" if self.complete else " (INCOMPLETE: rerun to resume)"),
                 f"generated {self.generated_tokens} tokens in {self.seconds:.1f}s = "
                 f"{self.tokens_per_s:.1f} tokens/s; prompt padding waste {100 * self.padding_waste:.1f}%"]
        for title, items in (("malformed prompt lines", self.malformed),
                             ("prompts skipped (this shard)", self.skipped),
                             ("invalid output records set aside and regenerated", self.invalid_records)):
            lines.append(f"{title}: {len(items)}")
            lines += [f"  line {n}: {why}" for n, why in items[:max_listed]]
            if len(items) > max_listed:
                lines.append(f"  ... and {len(items) - max_listed} more")
        return "\n".join(lines)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def regenerate(target, tokenizer, prompts_path: str | os.PathLike, out_path: str | os.PathLike, *,
               settings: GenerationSettings = GenerationSettings(), batch_size: int = 8,
               process_index: int | None = None, process_count: int | None = None,
               target_path: str | os.PathLike | None = None, max_records: int | None = None,
               max_prompt_tokens: int | None = None, cache_multiple: int = 64,
               progress: bool = True, max_skipped_fraction: float = 0.01,
               enable_thinking: bool = False, program_dir: str | None = None) -> RegenerationSummary:
    """Regenerate responses for every prompt of this process's shard not yet in the output.

    ``max_records`` stops after that many new records (a partial run; rerun to continue).
    Prompts longer than ``max_prompt_tokens`` (default: what fits before the target's
    ``max_position_embeddings`` with ``max_new_tokens`` left) are skipped and listed.  Malformed
    lines and prompts the template or vocabulary rejects are skipped and listed too; more than
    ``max_skipped_fraction`` of them, or no usable prompt, stop the run before generating.
    Output records that cannot count as done (``response_token_ids`` of ``"oops"``) are set
    aside, listed, and regenerated.  ``program_dir``: the decoder's compiled programs are kept
    there across runs (:mod:`d3d_jax.compile_cache`), so a rerun compiles nothing.
    """
    import jax

    max_prompt_tokens = _check_limits(target, tokenizer, settings, max_records, max_prompt_tokens, target_path)
    process_count = jax.process_count() if process_count is None else process_count
    process_index = jax.process_index() if process_index is None else process_index
    prompts, malformed = read_prompts(prompts_path)
    mine = shard_prompts(prompts, process_index, process_count)
    out = shard_output_path(out_path, process_index, process_count)
    summary = RegenerationSummary(output=str(out), prompt_lines=len(prompts), shard_prompts=len(mine),
                                  malformed=malformed)
    run = _Run(settings=settings, generation=dataclasses.asdict(settings),
               template=template_identity(tokenizer, enable_thinking),
               target_id=target_identity(target, target_path), eos_ids=stop_token_ids(target, tokenizer, target_path))
    done = _resume(out, run, target.config.vocab_size, summary)
    summary.already_done = sum(p.id in done for p in mine)

    usable, token_ids, rejected = _render_all(mine, tokenizer, max_prompt_tokens, target.config.vocab_size, summary,
                                              {"enable_thinking": enable_thinking})
    first = (malformed + summary.skipped)[:1]
    rec_lib.check_skipped_fraction(len(malformed) + rejected, len(prompts) + len(malformed), max_skipped_fraction,
                                   str(prompts_path), "max_skipped_fraction",
                                   f"line {first[0][0]}: {first[0][1]}" if first else None)
    if mine and not usable:
        raise DataError(f"{prompts_path}: none of this shard's {len(mine)} prompts is usable "
                        f"(first: line {summary.skipped[0][0]}: {summary.skipped[0][1]})")
    lengths = [len(t) for t in token_ids]
    cache_len = run_cache_len(lengths, settings.max_new_tokens, cache_multiple)
    # from every usable prompt of the shard, not only those left: a rerun pads alike
    widths = prompt_widths(lengths, cache_multiple)
    summary.padding_waste = padding_waste(lengths, cache_len, widths)
    # queued by length, then id: neighbours in the queue are admitted together, one program a bucket
    todo = [i for b in plan_batches([p.id for p in usable], lengths, batch_size) for i in b
            if usable[i].id not in done][:max_records]
    if todo:
        _write_records(_decoder(target, batch_size, cache_len, program_dir, widths), tokenizer, out, [usable[i] for i in todo],
                       [token_ids[i] for i in todo], run, summary, progress=progress)
    return summary


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every record of this run says about how it was made."""

    settings: GenerationSettings
    generation: dict
    template: dict
    target_id: dict
    eos_ids: tuple[int, ...]


def _check_limits(target, tokenizer, settings: GenerationSettings, max_records: int | None,
                  max_prompt_tokens: int | None, target_path) -> int:
    """Everything checkable before reading a prompt; returns the prompt length limit."""
    settings.validate()
    if max_records is not None and max_records < 0:
        raise UsageError(f"max_records must be >= 0, got {max_records}")
    max_pos = target.config.context_length
    rec_lib.check_context(1, settings.max_new_tokens, max_pos, model=str(target_path or "the target"))
    limit = max_pos - settings.max_new_tokens
    if max_prompt_tokens is None:
        max_prompt_tokens = limit
    if max_prompt_tokens < 1 or max_prompt_tokens > limit:
        raise UsageError(f"max_prompt_tokens must be in [1, {limit}] (max_position_embeddings "
                         f"{max_pos} - max_new_tokens), got {max_prompt_tokens}")
    if len(tokenizer) > target.config.vocab_size:
        raise ModelFileError(f"the tokenizer has {len(tokenizer)} tokens but the target's vocab_size is "
                             f"{target.config.vocab_size}")
    return max_prompt_tokens


def _resume(out: Path, run: _Run, vocab_size: int, summary: RegenerationSummary) -> set[str]:
    """Ids already done in ``out``; records that cannot count as done are set aside and listed."""
    existing = recover_output(out, vocab_size)
    invalid = [r for r in existing if r["problem"] is not None]
    if invalid:
        set_aside(out, [r["line"] for r in invalid])
        summary.invalid_records = [(r["line"], f"id {r['id']!r}: {r['problem']}") for r in invalid]
    valid = [r for r in existing if r["problem"] is None]
    check_compatible(valid, run.generation, run.target_id, out)
    return {r["id"] for r in valid}


def _write_records(decoder, tokenizer, out: Path, prompts: Sequence[Prompt], token_ids, run: _Run,
                   summary: RegenerationSummary, *, progress: bool) -> None:
    """Every prompt through the engine's continuous batching; each record appended (whole, fsynced)
    as its row finishes.  A record depends on its prompt, the settings and its own seed only, so
    a resumed run writes what an uninterrupted one would, in whatever order rows finish."""
    from tqdm.auto import tqdm

    from d3d_jax.decoding import engine
    from d3d_jax.io.atomic import writing

    with writing(out):
        out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(prompts), unit="prompt", desc=f"regenerate {out.name}", disable=not progress)
    start, cpu_start = time.perf_counter(), time.process_time()
    settings = run.settings
    sampling = engine.SamplingParams(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k)
    stream = engine.generate_stream(decoder, token_ids, sampling=sampling, max_new_tokens=settings.max_new_tokens,
                                    eos_token_ids=run.eos_ids, seed=settings.seed,
                                    row_seeds=[record_seed(settings.seed, p.id) for p in prompts])
    with writing(out), open(out, "ab") as f:
        for finished in stream:
            records = [_record(prompts[i], token_ids[i], o, tokenizer, run.generation, run.template, run.target_id)
                       for i, o in finished]
            append_records(f, records)
            summary.written += len(records)
            summary.generated_tokens += sum(len(r["response_token_ids"]) for r in records)
            summary.seconds = time.perf_counter() - start
            bar.update(len(records))
            bar.set_postfix(tok_s=f"{summary.tokens_per_s:.1f}")
    bar.close()
    summary.seconds = time.perf_counter() - start
    summary.cpu_seconds = time.process_time() - cpu_start


def _max_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` stands for (a byte-level BPE entry's length
    is its byte count, which bounds its characters): a text longer than ``n`` times this has more
    than ``n`` tokens, known without tokenizing it."""
    try:
        return max(1, max(len(t) for t in tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError):  # no vocabulary to read: 1 KB per token is safe
        return 1024


def _render_all(prompts: Sequence[Prompt], tokenizer, max_prompt_tokens: int, vocab_size: int,
                summary: RegenerationSummary, template_kwargs: dict | None = None
                ) -> tuple[list[Prompt], list[np.ndarray], int]:
    """Prompt ids of every prompt that renders, fits the vocabulary and ``max_prompt_tokens``; the
    others go into ``summary.skipped`` with the reason.  Also returns how many were rejected as bad
    (template or vocabulary; a prompt over the length limit is the limit working, not a bad one)."""
    usable, token_ids, rejected = [], [], 0
    max_chars = max_prompt_tokens * _max_token_chars(tokenizer)
    for p in prompts:
        chars = sum(len(m["content"]) for m in p.messages)
        if chars > max_chars:  # cannot fit: not tokenized (50 MB of text took 12 GB and minutes)
            summary.skipped.append((p.line, f"id {p.id!r}: prompt has {chars} characters, more than "
                                            f"{max_prompt_tokens} tokens can hold"))
            continue
        try:
            ids = rec_lib.token_ids(render_prompt(tokenizer, p.messages, template_kwargs), "rendered prompt",
                                    vocab_size)
        except Exception as e:  # a template may reject a turn order (e.g. system not first)
            why = str(e) if isinstance(e, RecordError) else f"chat template failed: {e}"
            summary.skipped.append((p.line, f"id {p.id!r}: {why}"))
            rejected += 1
            continue
        if len(ids) > max_prompt_tokens:
            summary.skipped.append((p.line, f"id {p.id!r}: prompt has {len(ids)} tokens > {max_prompt_tokens}"))
            continue
        usable.append(p)
        token_ids.append(ids)  # an array, not a list: ~36 bytes/token as Python ints
    return usable, token_ids, rejected


def _record(prompt: Prompt, prompt_ids: Sequence[int], output, tokenizer, generation: dict, template: dict,
            target_id: dict) -> dict:
    ids = [int(t) for t in output.token_ids]
    return {
        "id": prompt.id,
        "messages": prompt.messages,
        "prompt_token_ids": [int(t) for t in prompt_ids],
        "response": tokenizer.decode(ids, skip_special_tokens=True),
        "response_token_ids": ids,
        "finish_reason": output.finish_reason,
        "generation": generation,
        "template": template,
        "target": target_id,
    }


def run_cache_len(prompt_lengths: Sequence[int], max_new_tokens: int, cache_multiple: int) -> int:
    """KV slots per row of a run's one decoder: the longest prompt rounded up to
    ``cache_multiple``, plus ``max_new_tokens`` and the engine's block slack, rounded up again."""
    prompt_pad = _round_up(max(prompt_lengths, default=1), cache_multiple)
    return _round_up(prompt_pad + max_new_tokens + ENGINE_BLOCK_SLACK, cache_multiple)


def _decoder(target, batch_size: int, cache_len: int, program_dir: str | None = None,
             widths: Sequence[int] = ()):
    """The run's plain decoder (``batch_size`` slots, rows decoded together).  Prompts are admitted
    padded to ``widths`` (:func:`prompt_widths`), one program each, so one decoder serves every
    length."""
    from d3d_jax.decoding import engine

    return engine.make_decoder(target, mode="plain", num_slots=batch_size, max_cache_len=cache_len,
                               program_dir=program_dir, prompt_widths=tuple(widths))
