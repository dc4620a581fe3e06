"""RequestOutputs to OpenAI response bodies and stream chunks.

Streaming sends one chunk per completion per paced output (app.py's STREAM_INTERVAL_S), so a chunk is a
few dict entries through json.dumps, framed as an SSE event here (bytes go out as they are): no pydantic
model, no re-detokenization (the engine's DELTA outputs already carry the new text). Chat choices are indexed by
completion; usage counts every completion's tokens.
"""
from __future__ import annotations

import json
import time

from pagednb.outputs import CompletionOutput, PositionLogprobs, RequestOutput


class Usage:
    """Token counts of one response, accumulated over its outputs (DELTA outputs carry new tokens only)."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def add(self, out: RequestOutput) -> None:
        self.prompt_tokens = len(out.prompt_token_ids)
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def merged_deltas(outputs: list[RequestOutput]) -> list[CompletionOutput]:
    """Consecutive DELTA outputs of one request as one delta per completion (in order of first change):
    text, tokens and logprobs joined, the finish reason of the last."""
    merged: dict[int, CompletionOutput] = {}
    for out in outputs:
        for c in out.outputs:
            into = merged.get(c.index)
            if into is None:
                logprobs = None if c.logprobs is None else list(c.logprobs)
                merged[c.index] = CompletionOutput(c.index, c.text, list(c.token_ids), c.finish_reason,
                                                   c.stop_reason, c.cumulative_logprob, logprobs)
                continue
            into.text += c.text
            into.token_ids += c.token_ids
            if c.logprobs is not None:
                into.logprobs = (into.logprobs or []) + c.logprobs
            into.finish_reason, into.stop_reason = c.finish_reason, c.stop_reason
            into.cumulative_logprob = c.cumulative_logprob
    return list(merged.values())


class ResponseBuilder:
    """The id, creation time and model name shared by a response's body or chunks."""

    def __init__(self, chat: bool, request_id: str, model: str, tokenizer, num_logprobs: int | None) -> None:
        self.chat = chat
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.num_logprobs = num_logprobs  # None: no logprobs in the response

    # ---- whole responses -------------------------------------------------------------------------
    def body(self, out: RequestOutput) -> dict:
        usage = Usage()
        usage.add(out)
        choices = [self._choice(c) for c in sorted(out.outputs, key=lambda c: c.index)]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": usage.as_dict()}

    def _choice(self, c: CompletionOutput) -> dict:
        logprobs = self._logprobs(c)
        if self.chat:
            return {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        return {"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    # ---- stream chunks ---------------------------------------------------------------------------
    def role_chunk(self, n: int) -> bytes:
        """Chat streams open with the assistant's role for each choice, as OpenAI's do."""
        return self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None} for i in range(n)])

    def delta_chunk(self, c: CompletionOutput) -> bytes:
        logprobs = self._logprobs(c)
        if self.chat:
            choice = {"index": c.index, "delta": {"content": c.text} if c.text or c.finish_reason is None else {},
                      "logprobs": logprobs, "finish_reason": c.finish_reason}
        else:
            choice = {"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}
        if c.finish_reason is not None:
            choice["stop_reason"] = c.stop_reason
        return self._chunk([choice])

    def usage_chunk(self, usage: Usage) -> bytes:
        return self._chunk([], usage.as_dict())

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        return sse_event(json.dumps(chunk, ensure_ascii=False))

    # ---- logprobs --------------------------------------------------------------------------------
    def _logprobs(self, c: CompletionOutput) -> dict | None:
        if self.num_logprobs is None or c.logprobs is None:
            return None
        positions = list(zip(c.token_ids, c.logprobs))
        return self._chat_logprobs(positions) if self.chat else self._completion_logprobs(positions)

    def _chat_logprobs(self, positions: list[tuple[int, PositionLogprobs]]) -> dict:
        """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}, OpenAI's chat shape."""
        content = []
        for token_id, position in positions:
            token = self._text(token_id, position[token_id].decoded_token)
            content.append({"token": token, "logprob": _finite(position[token_id].logprob),
                            "bytes": list(token.encode()),
                            "top_logprobs": [{"token": text, "logprob": logprob, "bytes": list(text.encode())}
                                             for text, logprob in self._top(position)]})
        return {"content": content}

    def _completion_logprobs(self, positions: list[tuple[int, PositionLogprobs]]) -> dict:
        """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}, the legacy completions shape."""
        tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
        for token_id, position in positions:
            token = self._text(token_id, position[token_id].decoded_token)
            tokens.append(token)
            token_logprobs.append(_finite(position[token_id].logprob))
            top.append(dict(self._top(position)))
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _top(self, position: PositionLogprobs) -> list[tuple[str, float]]:
        """The num_logprobs most likely tokens (the chosen one too when it is among them)."""
        ranked = sorted(position.items(), key=lambda item: item[1].rank)[:self.num_logprobs]
        return [(self._text(t, lp.decoded_token), _finite(lp.logprob)) for t, lp in ranked]

    def _text(self, token_id: int, decoded: str | None) -> str:
        return decoded if decoded is not None else self.tokenizer.decode([token_id])


def _finite(logprob: float) -> float:
    """-inf is not JSON: OpenAI's servers send a very negative number instead, as vLLM (-9999.0)."""
    return max(logprob, -9999.0)


def sse_event(data: str) -> bytes:
    """One SSE event (json.dumps never emits a newline, so the data is one line)."""
    return b"data: " + data.encode() + b"\n\n"


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
