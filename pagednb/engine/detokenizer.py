"""Incremental detokenization of one request's output, with stop strings.

Text is produced by decoding a window of recent token ids and keeping what the newest ids added
(the "prefix/read offset" scheme): decoding ids together, rather than one by one, keeps the
spaces a tokenizer only renders between tokens, and a window that ends on a byte-incomplete
character (a lone "\ufffd") is held back until its remaining bytes arrive. Fast tokenizers use
`tokenizers.decoders.DecodeStream`, which runs the same scheme in Rust.

Invariant: the concatenation of all `take_delta()` results equals the final `output_text`, whether
it was streamed or decoded once at the end (FINAL_ONLY, what `generate` asks for).

A prompt may end inside a multi-byte character (token ids that split an emoji or an accented letter).
The rule, as in vLLM: the output text starts right after the prompt's last *whole* character, so the
prompt's trailing bytes are held like an output token that has not completed its character yet. A
character that the first output tokens complete is emitted in the output; bytes that the output never
completes show as "\ufffd" at its start, as any incomplete bytes do when a request finishes. Streaming
and the one decode at the end follow the same rule, so they give the same text. "Whole" is what the
prompt's decoding shows: a byte-fallback tokenizer decodes a run of byte tokens as one unit, so a
character sharing its run with the split one is held with it, and a prompt that really ends in a
U+FFFD character is taken as split.
"""
from __future__ import annotations

import inspect
from functools import partial

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from pagednb.sampling_params import RequestOutputKind, SamplingParams

# Trailing prompt tokens decoded with the output so its first token keeps its leading space
# (metaspace "▁" tokenizers strip the space of the first decoded token).
CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(
            tokenizer, "backend_tokenizer", None)
        skip = params.skip_special_tokens
        # detokenize=False (vLLM's): no text at all, token ids only; nothing below is ever decoded
        self._enabled = params.detokenize
        if backend is not None:
            self._decode = partial(backend.decode, skip_special_tokens=skip)
        else:  # a slow tokenizer: no cleanup, or deltas would not add up
            self._decode = partial(tokenizer.decode, skip_special_tokens=skip, clean_up_tokenization_spaces=False,
                                   **_spacing_option(tokenizer, params.spaces_between_special_tokens))
        context = list(prompt_token_ids[-CONTEXT_TOKENS:]) if self._enabled else []
        self._ids = context  # context + output ids
        self._prefix = 0  # ids[prefix:read] decode to the text emitted last
        self._read = len(context)
        # The text that ids[prefix:read] stand for, when it is not their decoding: a prompt that ends
        # inside a character stands for its whole characters only (see the module docstring).
        self._read_text: str | None = None
        if context:
            decoded = self._decode(context)
            if decoded.endswith(_INCOMPLETE):
                self._read_text = decoded.rstrip(_INCOMPLETE)
        self._num_output = 0
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # A delta must not show the start of a stop string that later completes.
        max_stop = max(map(len, self._stops), default=0)
        self._holdback = 0 if self._include_stop else max(0, max_stop - 1)
        # Nobody looks at the text before the end: decode once when the request finishes.
        self._deferred = not self._enabled or (params.output_kind is RequestOutputKind.FINAL_ONLY
                                               and not self._stops)
        self._backend = backend
        self._skip = skip
        # DecodeStream cannot start on a split character: the window scheme runs until the prompt's
        # split character is out, then the stream takes over (_decode_new).
        self._use_stream = backend is not None and not self._deferred
        self._stream = (DecodeStream(ids=context, skip_special_tokens=skip)
                        if self._use_stream and self._read_text is None else None)
        self._text = ""
        self._shown = 0  # chars of _text already returned by take_delta
        self._finished = False

    def update(self, new_token_ids: list[int], finished: bool) -> str | None:
        """Adds tokens; returns the stop string if one now appears in the text.

        The caller then finishes the request; later updates are ignored.
        """
        if self._finished or not self._enabled:
            self._finished = self._finished or finished
            return None
        self._ids += new_token_ids
        self._num_output += len(new_token_ids)
        start = len(self._text)
        if not self._deferred:
            self._text += self._decode_new(new_token_ids)
        if finished:
            self._text += self._decode_window(final=True)
        stop = self._find_stop(start)
        self._finished = finished or stop is not None
        return stop

    @property
    def defers_until_finished(self) -> bool:
        """True when nothing is decoded before the end (FINAL_ONLY, no stop strings): callers may
        skip the per-step update and hand over every token at once when the request finishes."""
        return self._deferred

    @property
    def finds_stop_strings(self) -> bool:
        """True when the text is searched for stop strings: it must then be decoded every step, so that
        the request stops at the token that completed one."""
        return bool(self._stops)

    @property
    def output_text(self) -> str:
        """Text safe to show so far; the final text once finished or stopped."""
        return self._text[:self._visible_len()]

    def take_delta(self) -> str:
        """The part of `output_text` not returned by an earlier call."""
        end = self._visible_len()
        delta = self._text[self._shown:end]
        self._shown = end
        return delta

    def _visible_len(self) -> int:
        if self._finished or not self._holdback:
            return len(self._text)
        return max(0, len(self._text) - self._holdback)

    def _decode_new(self, new_token_ids: list[int]) -> str:
        if self._stream is None:
            window = self._ids[self._prefix:]
            text = self._decode_window(final=False)
            if text and self._use_stream:  # the window now decodes to whole characters: hand over
                self._stream = DecodeStream(ids=window, skip_special_tokens=self._skip)
            return text
        chunk = self._stream.step(self._backend, new_token_ids)
        if chunk is None:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return chunk

    def _decode_window(self, final: bool) -> str:
        """Text added by ids[read:]; unless `final`, "" while it may end mid-character."""
        if self._read == len(self._ids):
            return ""
        old = self._read_text if self._read_text is not None else self._decode(self._ids[self._prefix:self._read])
        new = self._decode(self._ids[self._prefix:])
        if not final and (len(new) <= len(old) or new.endswith(_INCOMPLETE)):
            return ""
        if self._read_text is None:
            self._prefix = self._read
        else:  # ids[read:] began inside the split character: the next window starts where this one did
            self._read_text = None
        self._read = len(self._ids)
        return new[len(old):]

    def _find_stop(self, start: int) -> str | None:
        """Finds the earliest stop string that overlaps text added after `start`; cuts there."""
        if not self._stops or self._num_output < self._min_tokens:
            return None
        best, best_at = None, len(self._text)
        for stop in self._stops:
            at = self._text.find(stop, max(0, start - len(stop) + 1), best_at + len(stop) - 1)
            if at != -1 and at < best_at:
                best, best_at = stop, at
        if best is not None:
            self._text = self._text[:best_at + (len(best) if self._include_stop else 0)]
        return best


def _spacing_option(tokenizer, spaces_between_special_tokens: bool) -> dict:
    """{"spaces_between_special_tokens": ...} for a slow tokenizer whose decode names that option (HF's
    SentencePiece ones); {} otherwise. Fast (Rust) tokenizers have no such option: their decoder
    decides, as in vLLM, whose fast detokenizer ignores it too."""
    for fn in (getattr(tokenizer, "_decode", None), tokenizer.decode):
        try:
            if fn is not None and "spaces_between_special_tokens" in inspect.signature(fn).parameters:
                return {"spaces_between_special_tokens": spaces_between_special_tokens}
        except (TypeError, ValueError):  # a builtin without a signature
            continue
    return {}
