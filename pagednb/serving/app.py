"""The FastAPI app: OpenAI's /v1/models, /v1/completions and /v1/chat/completions, plus /health and
/metrics, answered by one LLM through its public async path (`llm.stream`).

A request's life: the body is checked (a bad field is a 400 naming it, with the Python API's message),
`llm.stream` queues it on the engine that the notebook's own cells use, and its outputs come back as one
JSON body or as SSE chunks ending in `data: [DONE]`. A client that disconnects mid-stream cancels the
response's generator, which leaves the stream's `async for` and so aborts the request: its blocks come
back at the next step. Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from pagednb.chat_template import apply_chat_template
from pagednb.sampling_params import SamplingParams
from pagednb.serving.metrics import ServerMetrics
from pagednb.serving.protocol import ChatCompletionRequest, CompletionRequest, RequestError, field_named_in
from pagednb.serving.responses import ResponseBuilder, Usage, error_body, merged_deltas, sse_event
from pagednb.streams import RequestStream

logger = logging.getLogger("pagednb")

# After a stream's first chunk, at most one chunk per this many seconds (each holding every token of the
# steps in between; the engine builds no output for the stream meanwhile, RequestStream.pace). Every
# chunk costs the server's single thread tens of microseconds (the engine's output and detokenization,
# JSON, SSE framing, the ASGI send, a socket write) on the loop that also steps the engine: one chunk
# per token at 256 streams would cost more per step than a GPU step of the whole batch, and throughput
# would fall by half. 20 chunks per second reads as smoothly as per-token streaming, and bounds that
# cost whatever the model's speed. TTFT is unaffected (the first tokens are sent at once), and so is the
# end (the final output comes at once).
STREAM_INTERVAL_S = 0.05


class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


class OpenAIServing:
    """What the endpoints do, apart from HTTP: check, submit to the shared engine, shape the answer."""

    def __init__(self, llm, model_name: str, metrics: ServerMetrics) -> None:
        self.llm = llm
        self.model_name = model_name
        self.metrics = metrics

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "pagednb",
            "root": self.llm.engine.config.model, "parent": None, "max_model_len": self.llm.max_model_len}]}

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        params = body.sampling_params()
        return await self._respond(body, request, body.prompt_input(), params, chat=False,
                                   num_logprobs=params.logprobs)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        params = body.sampling_params()
        try:
            prompt_ids = apply_chat_template(self.llm.get_tokenizer(), body.messages, body.add_generation_prompt,
                                             body.chat_template_kwargs)
        except (TypeError, ValueError) as error:
            raise RequestError(str(error), field_named_in(str(error))) from None
        return await self._respond(body, request, {"prompt_token_ids": prompt_ids}, params, chat=True,
                                   num_logprobs=params.logprobs)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           "NotFoundError", "model")

    async def _respond(self, body, request: Request, prompt, params: SamplingParams, chat: bool,
                       num_logprobs: int | None) -> Response:
        include_usage = body.include_usage
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            stream = self.llm.stream(prompt, params, request_id=request_id)
        except (TypeError, ValueError) as error:  # checks that need the model: prompt length, vocabulary
            raise RequestError(str(error), field_named_in(str(error))) from None
        except RuntimeError as error:  # closed, asleep or dead: the server is up but cannot answer
            raise ApiError(503, str(error), "ServiceUnavailableError") from None
        builder = ResponseBuilder(chat, request_id, self.model_name, self.llm.get_tokenizer(), num_logprobs)
        if body.stream:
            async def client_left(message: dict) -> None:  # aborted at the next step; its blocks come back
                stream.abort()
            return EventSourceResponse(self._events(stream, builder, params.n, include_usage),
                                       client_close_handler_callable=client_left)
        final = asyncio.ensure_future(self._final(stream, params.n))
        left = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait((final, left), return_when=asyncio.FIRST_COMPLETED)
        left.cancel()
        if not final.done():  # the client left: cancelling the wait aborts the request
            final.cancel()
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        return JSONResponse(builder.body(final.result()))

    async def _final(self, stream: RequestStream, n: int):
        final = None
        try:
            async for out in stream:  # FINAL_ONLY: one output, with every completion
                final = out
        except Exception as error:
            raise ApiError(500, f"the request failed: {error!r}", "InternalServerError") from None
        self.metrics.observe(final, sum(len(c.token_ids) for c in final.outputs), n)
        return final

    async def _events(self, stream: RequestStream, builder: ResponseBuilder, n: int,
                      include_usage: bool) -> AsyncIterator[bytes]:
        """The SSE events: (chat: the role), a chunk per completion that changed, the usage if asked, then
        [DONE]. The first tokens go out at once; after that a chunk carries what the engine produced
        during the last STREAM_INTERVAL_S (see there). Leaving early aborts the request."""
        usage, final = Usage(), None
        stream.pace(STREAM_INTERVAL_S)
        try:
            if builder.chat:
                yield builder.role_chunk(n)
            while True:
                try:
                    outs = [await anext(stream)]
                except StopAsyncIteration:
                    break
                outs += stream.take_ready()  # the final output may be queued right behind (never held)
                for out in outs:
                    usage.add(out)
                for completion in merged_deltas(outs):
                    if completion.text or completion.finish_reason is not None or completion.logprobs:
                        yield builder.delta_chunk(completion)
                final = outs[-1]
            if include_usage:
                yield builder.usage_chunk(usage)
        except Exception as error:  # the engine failed: say so in the stream, which is already under way
            yield sse_event(json.dumps(error_body(f"the request failed: {error!r}", "InternalServerError", 500)))
        finally:
            stream.abort()  # a no-op once finished; else the client left (the generator is closed)
        if final is not None:
            self.metrics.observe(final, usage.completion_tokens, n)
        yield sse_event("[DONE]")


async def _disconnected(request: Request) -> None:
    """Returns when the client of a non-streaming request closes the connection (the body is read, so
    the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(llm, model_name: str, api_key: str | None = None) -> FastAPI:
    """The ASGI app serving `llm` under `model_name`; with `api_key`, /v1/* needs `Authorization: Bearer
    <api_key>` (compared in constant time). /health and /metrics stay open, as in vLLM."""
    metrics = ServerMetrics(llm, model_name)
    serving = OpenAIServing(llm, model_name, metrics)
    app = FastAPI(title="pagednb", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics
    _add_error_handlers(app)
    authorized = [Depends(_api_key_check(api_key))]

    @app.get("/health")
    async def health() -> Response:
        alive = not llm.engine.closed and llm.driver.dead is None
        return Response(status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict:
        return serving.models()

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat_completions(body, request)

    return app


def _api_key_check(api_key: str | None):
    expected = None if api_key is None else api_key.encode()

    async def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise ApiError(401, "Unauthorized: send the server's API key as 'Authorization: Bearer <key>'",
                           "AuthenticationError")
    return check


def _add_error_handlers(app: FastAPI) -> None:
    def reply(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(message, kind, status, param), status_code=status)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return reply(error.status, error.message, error.kind, error.param)

    @app.exception_handler(RequestError)
    async def bad_request(request: Request, error: RequestError) -> JSONResponse:
        return reply(400, str(error), "BadRequestError", error.param)

    @app.exception_handler(RequestValidationError)
    async def malformed_body(request: Request, error: RequestValidationError) -> JSONResponse:
        """A body that is not JSON, or not an object of the right shape: 400, as vLLM maps FastAPI's 422."""
        first = error.errors()[0] if error.errors() else {}
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid request body')}"
        return reply(400, message, "BadRequestError", ".".join(where) or None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return reply(error.status_code, str(error.detail), "NotFoundError" if error.status_code == 404 else "Error")
