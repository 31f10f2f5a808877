"""The demo's prompts: real text in, chat rows out (``train/pipeline.py`` builds on them).

The demo target is a tiny Qwen3 pretrained here on Shakespeare and stdlib source.  So that the
benchmark's chat-formatted prompts (HumanEval, held-out plays) mean something to it, pretraining
rows are *continuation dialogues*: the user turn holds the first lines of a passage, the
assistant turn (after Qwen3's empty non-thinking block) continues it.  The target therefore
behaves like a small instruct model whose task is "continue this text".
"""

from __future__ import annotations

import random
from typing import Sequence

from d3d_jax.demo import corpus

HEAD_FRACTION = 0.35  # share of a passage's lines that goes into the user turn


def continuation_pairs(split: str, passage_chars: int = 700, max_pairs: int | None = None,
                       sources: Sequence[str] = ("shakespeare", "python"), seed: int = 0,
                       max_chars: int | None = None) -> list[dict]:
    """``{"source", "prompt", "response"}`` pairs cut from the corpus split, shuffled with ``seed``."""
    pairs = []
    for src in sources:
        for doc in corpus.load_corpus(split, sources=(src,), max_chars=max_chars):
            for passage in corpus.split_passages(doc, passage_chars):
                lines = passage.splitlines(keepends=True)
                if len(lines) < 3:
                    continue
                cut = max(1, int(len(lines) * HEAD_FRACTION))
                head, tail = "".join(lines[:cut]), "".join(lines[cut:])
                if head.strip() and tail.strip():
                    pairs.append({"source": src, "prompt": head, "response": tail})
    random.Random(seed).shuffle(pairs)
    return pairs[:max_pairs] if max_pairs else pairs


MIN_DOCSTRING_CHARS = 40  # a one-line "Return x." docstring says too little to continue from
MAX_IMPORT_CHARS = 400  # HumanEval's headers are an import line or two


def _stub_of(fn, lines: list[str], imports: str, max_chars: int) -> dict | None:
    """HumanEval's shape for one function: imports, the signature and the docstring as the
    prompt; the original body as the response (regeneration replaces it with the target's)."""
    import ast

    body = fn.body
    doc = ast.get_docstring(fn, clean=False)
    if not doc or len(doc.strip()) < MIN_DOCSTRING_CHARS or len(body) < 2:
        return None
    indent = fn.col_offset
    seg = lines[fn.lineno - 1: body[0].end_lineno]
    rest = lines[body[0].end_lineno: fn.end_lineno]
    dedent = [ln[indent:] if ln[:indent].strip() == "" else ln.lstrip() for ln in seg + rest]
    stub, tail = "".join(dedent[:len(seg)]), "".join(dedent[len(seg):])
    prompt = (imports + "\n\n\n" if imports else "") + stub
    if len(prompt) > max_chars or not tail.strip():
        return None
    return {"prompt": prompt, "response": tail}


def function_stubs(text: str, max_chars: int = 1500) -> list[dict]:
    """Every function and method of a module with a real docstring, as ``{"prompt",
    "response"}`` (methods dedented to the top level, as HumanEval's stubs are)."""
    import ast

    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    # The header: the module's import lines, cut at the last line break within MAX_IMPORT_CHARS.
    # That cut also drops the last line of a header shorter than the limit; the shipped
    # regeneration data was made with this rule, and any other one picks other stubs (their
    # lengths decide which fit max_chars), so changing it means regenerating the data and
    # retraining every drafter (tests/test_demo.py checks the shipped prompts are this code's).
    imports = "\n".join(ast.get_source_segment(text, n) or "" for n in tree.body
                        if isinstance(n, (ast.Import, ast.ImportFrom)))
    imports = imports[:MAX_IMPORT_CHARS].rsplit("\n", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stub = _stub_of(node, lines, imports if node.col_offset == 0 else "", max_chars)
            if stub is not None:
                out.append(stub)
    return out


def docstring_prompts(splits: Sequence[str] = ("prompts", "pretrain"), max_pairs: int | None = None,
                      seed: int = 0, max_chars: int = 1500) -> list[dict]:
    """``{"source": "stdlib_doc", "prompt", "response"}``: signature-and-docstring stubs of the
    standard library's functions in ``splits`` (never ``eval``), shuffled with ``seed``.  They put
    the code benchmark's prompt shape (HumanEval: imports, a signature, a docstring) into the
    regeneration prompts without using any of its problems."""
    if "eval" in splits:
        raise ValueError("docstring_prompts: the eval split is held out of every training prompt")
    pairs = []
    for split in splits:
        for path in corpus.stdlib_files(split):
            for stub in function_stubs(path.read_text(encoding="utf-8", errors="replace"), max_chars):
                pairs.append({"source": "stdlib_doc", **stub})
    random.Random(seed).shuffle(pairs)
    return pairs[:max_pairs] if max_pairs else pairs
