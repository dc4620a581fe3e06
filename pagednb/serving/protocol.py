"""The OpenAI request bodies (vLLM's field names) and their mapping onto pagednb's SamplingParams.

The models only give the body its shape: a sampling field is typed `Any`, so a bad value is not refused
by pydantic with its own wording but by SamplingParams, with the message the Python API gives
("top_p must be in (0, 1], got 2"); the server turns that into a 400 naming the same field. Unknown
fields are ignored, as by vLLM's server.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict

from pagednb.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

# Sampling fields passed to SamplingParams under the same name when the body sets them (null = default).
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
                    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                    "allowed_token_ids", "bad_words", "best_of")


class RequestError(ValueError):
    """A request the server refuses with 400, naming the body field at fault (`param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _SamplingBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = False
    stream_options: dict | None = None
    max_tokens: Any = None
    n: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    min_p: Any = None
    seed: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    best_of: Any = None
    logit_bias: Any = None
    response_format: Any = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        """stream_options.include_usage: a last chunk with the usage (only with stream=true, as vLLM)."""
        if self.stream_options is None:
            return False
        if not self.stream:
            raise RequestError("stream_options can only be given with stream=true", "stream_options")
        value = self.stream_options.get("include_usage", False)
        if not isinstance(value, bool):
            raise RequestError(f"stream_options.include_usage must be true or false, got {value!r}", "stream_options")
        return value

    def _sampling_params(self, max_tokens: object, logprobs: object) -> SamplingParams:
        kwargs = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        kwargs["max_tokens"] = max_tokens
        kwargs["logprobs"] = logprobs
        kwargs["logit_bias"] = _logit_bias(self.logit_bias)
        kwargs["structured_outputs"] = _structured_outputs(self.response_format)
        kwargs["output_kind"] = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        try:
            return SamplingParams(**kwargs)
        except (TypeError, ValueError) as error:
            raise RequestError(str(error), field_named_in(str(error))) from None


class CompletionRequest(_SamplingBody):
    """POST /v1/completions. One prompt per request: a str or a list of token ids."""

    prompt: Any = None
    max_tokens: Any = 16  # OpenAI's default for completions
    logprobs: Any = None  # an int: the top alternatives per position
    echo: bool = False
    suffix: str | None = None

    def prompt_input(self) -> str | dict:
        """The prompt as the engine takes it; a batch of prompts is refused with a clear message."""
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return {"prompt_token_ids": prompt}
        if isinstance(prompt, list):
            raise RequestError("prompt must be one prompt (a str or a list of token ids): pagednb's server takes "
                               "one prompt per request; send one request per prompt", "prompt")
        raise RequestError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}", "prompt")

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise RequestError("echo=true is not supported: the response holds the completion only", "echo")
        if self.suffix is not None:
            raise RequestError("suffix is not supported", "suffix")
        if isinstance(self.logprobs, bool):
            raise RequestError(f"logprobs must be an int >= 0 (the alternatives per position), got {self.logprobs}",
                               "logprobs")
        return self._sampling_params(self.max_tokens, self.logprobs)


class ChatCompletionRequest(_SamplingBody):
    """POST /v1/chat/completions."""

    messages: Any = None
    max_completion_tokens: Any = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = None
    top_logprobs: Any = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (self.top_logprobs if self.top_logprobs is not None else 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, logprobs)


def field_named_in(message: str) -> str | None:
    """The field a pagednb error message starts with ("top_p must be ..." -> "top_p")."""
    match = re.match(r"([a-z_]+)", message)
    return match.group(1) if match else None


def _logit_bias(bias: object) -> dict | None:
    """OpenAI sends token ids as JSON object keys, so as strings: "42" -> 42."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias must be an object of token id -> number, got {type(bias).__name__}",
                           "logit_bias")
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise RequestError(f"logit_bias keys must be token ids (integers), got {list(bias)!r:.80}",
                           "logit_bias") from None


def _structured_outputs(response_format: object) -> StructuredOutputsParams | None:
    """response_format {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON schema object", "response_format")
        return StructuredOutputsParams(json=schema)
    raise RequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                       "response_format")
