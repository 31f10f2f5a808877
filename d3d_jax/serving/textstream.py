"""Incremental detokenization with stop strings, for streaming.

A token can end in the middle of a UTF-8 character (byte-level BPE), so text is released only
once its decoding no longer ends in U+FFFD; and a stop string can straddle tokens, so the last
``len(longest stop) - 1`` characters are held back until the next token shows they are not the
start of one.  With ``min_tokens``, text released before that many tokens is never searched (a
stop string may still begin in it and end after).  Decoding windows start a few tokens before the read position (vLLM's
prefix/read offsets), so the cost per token does not grow with the output.  The concatenation of
everything released equals ``tokenizer.decode(output_ids)`` (cut at the first stop string).
"""

from __future__ import annotations

from typing import Sequence

_CONTEXT = 6  # prompt tokens decoded before the output, so the first token's text is in context


class TextStream:
    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, min_tokens: int = 0, keep: dict[int, str] | None = None):
        self.tok = tokenizer
        self.keep = keep or {}  # special tokens written out all the same (id -> text): a reasoning parser's tags
        self.min_tokens = min_tokens  # stop strings count only once this many tokens are out (vLLM)
        self.skip = skip_special_tokens
        self.stop = tuple(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._ids = list(prompt_ids[-_CONTEXT:])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # tokens before this are in self.text
        self._n_prompt = len(self._ids)
        self.text = ""  # decoded output so far (cut at a stop string)
        self._sent = 0  # characters of self.text already released
        self.stopped = False  # a stop string was matched
        self.n_tokens = 0  # output tokens consumed (up to the one that completed a stop string)

    def _decode(self, ids) -> str:
        if not (self.skip and self.keep and any(t in self.keep for t in ids)):
            return self.tok.decode(ids, skip_special_tokens=self.skip)
        parts, run = [], []
        for t in ids:
            if t in self.keep:
                parts += [self.tok.decode(run, skip_special_tokens=True), self.keep[t]]
                run = []
            else:
                run.append(t)
        return "".join(parts + [self.tok.decode(run, skip_special_tokens=True)])

    def _advance(self, final: bool) -> str:
        """Text of the tokens after the read offset, if complete (or ``final``)."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text):]
        return ""

    def _find_stop(self, start: int) -> int:
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def push(self, token_ids: Sequence[int]) -> str:
        """Consume new output tokens; return the text that is now safe to send."""
        for t in token_ids:
            if self.stopped:
                break
            self._ids.append(int(t))
            self.n_tokens += 1
            delta = self._advance(final=False)
            if delta and self.stop and self.n_tokens >= self.min_tokens:
                start = max(0, len(self.text) - self._hold)
                self.text += delta
                cut = self._find_stop(start)
                if cut >= 0:
                    self.text, self.stopped = self.text[:cut], True
            else:
                self.text += delta
        end = len(self.text) if self.stopped else max(self._sent, len(self.text) - self._hold)
        return self._release(end)

    def flush(self) -> str:
        """At the end of the output: any incomplete character as U+FFFD, and the held-back text."""
        if not self.stopped and len(self._ids) > self._read:
            start = max(0, len(self.text) - self._hold)
            self.text += self._advance(final=True)
            cut = self._find_stop(start) if self.stop else -1
            if cut >= 0:
                self.text, self.stopped = self.text[:cut], True
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        out = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return out

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._n_prompt:]
