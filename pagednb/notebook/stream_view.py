"""`stream()`: one request's text appearing live in a cell, with a Cancel button and a status line.

The cell returns at once; a task on the running loop (the kernel's) consumes `llm.stream()` and renders
through throttles, so the widgets get at most ~30 text updates a second however fast tokens come, and
the final state always lands. The Cancel button only calls `llm.abort()` (thread-safe, as ipykernel
7.0-7.3 may run handlers on another thread); the consuming task sees the request end with
finish_reason "abort" and renders that itself, so widgets are only ever touched on the loop's thread.

The "Token probabilities" toggle swaps the text for a token view (token_view.py): each token coloured by
its probability, its top-k alternatives on hover. A view opened with `token_view=True` asks the engine
for logprobs (the caller's `logprobs=k`, else DEFAULT_TOP_K) and colours the tokens live. Any other view
asks for none (they cost the engine a few percent of every step, for replies nobody may inspect) unless
the caller did; pressing its toggle then scores the reply: the prompt and the reply so far, prefilled once
with `prompt_logprobs` (the same raw logprobs), and once more when a running reply ends. The token widget
is created only when the toggle is first pressed; the toggle's handler, like Cancel, only hands the
switch to the loop's thread.

Views fail soft: a rendering error (a Markdown bug, a widget that refuses a value) is logged once and
the view falls back to plain escaped text; it never stops the consuming task, so the view still ends
with its final text and status, Cancel disabled, and `await view` gives the final output.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import ipywidgets as widgets

from pagednb.notebook.display import Displayable
from pagednb.notebook.markdown import markdown_to_html, plain_to_html
from pagednb.notebook.prompts import engine_prompt
from pagednb.notebook.throttle import BUDGET, STATUS_HZ, TEXT_HZ, Throttle
from pagednb.notebook.token_view import DEFAULT_TOP_K, TokenView
from pagednb.outputs import CompletionOutput, RequestOutput
from pagednb.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagednb")

# The engine's default (16 tokens) suits batch calls; a view is for reading a whole reply.
DEFAULT_MAX_TOKENS = 256


def streaming_params(sampling_params: SamplingParams | None, token_view: bool = False) -> SamplingParams:
    """The caller's params (a copy), made to report the cumulative text at every step; for a view whose
    token view is open from the start, with the logprobs it draws (the caller's k if they asked)."""
    params = sampling_params.clone() if sampling_params is not None else SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
    params.output_kind = RequestOutputKind.CUMULATIVE
    if token_view and params.logprobs is None:
        params.logprobs = DEFAULT_TOP_K
    return params


class StreamView(Displayable):
    """A live view of one request. `await view` (or `await view.result()`) gives the final RequestOutput."""

    def __init__(self, llm, prompt, sampling_params: SamplingParams | None = None, *, markdown: bool = True,
                 request_id: str | None = None, show_cancel: bool = True, text_css: str = "",
                 on_final: Callable[[RequestOutput | None], None] | None = None, token_view: bool = False) -> None:
        loop = _running_loop()
        self._llm = llm
        # Started before any widget exists: a bad prompt raises here and leaves nothing behind.
        self._stream = llm.stream(engine_prompt(llm, prompt), streaming_params(sampling_params, token_view),
                                  request_id=request_id)
        self.request_id: str = self._stream.request_id
        self._to_html = markdown_to_html if markdown else plain_to_html
        self._text_css = text_css
        self._on_final = on_final
        self._started = time.monotonic()
        self._latest: RequestOutput | None = None
        self._failed: set[str] = set()  # rendering steps that failed (each logged once)
        self._loop = loop
        self.tokens: TokenView | None = None  # created when the token toggle is first pressed
        self._showing_tokens = False
        self._scored: CompletionOutput | None = None  # the reply's scored tokens, when it has no logprobs
        self._scoring: asyncio.Task | None = None

        # CSS classes given to the constructors travel in the widgets' comm_open: add_class() afterwards
        # would send one more message per widget, a burst of them when several views open at once.
        self.text = widgets.HTML(self._wrap(""), _dom_classes=["pagednb-stream-text"])
        self.status = widgets.Label("waiting for the first token…", _dom_classes=["pagednb-status"])
        self.cancel_button = widgets.Button(description="Cancel", icon="stop", button_style="warning",
                                            layout=widgets.Layout(width="auto"),
                                            _dom_classes=["pagednb-cancel"])
        self.cancel_button.on_click(lambda _button: self.cancel())
        self.token_button = widgets.ToggleButton(value=token_view, description="Token probabilities", icon="eye",
                                                 tooltip="colour each token by its probability; hover a token "
                                                         "for the alternatives", layout=widgets.Layout(width="auto"),
                                                 _dom_classes=["pagednb-token-toggle"])
        self.token_button.observe(lambda change: loop.call_soon_threadsafe(
            self._soft, lambda: self._show_tokens(change["new"]), "switching the token view"), "value")
        footer = [self.cancel_button] if show_cancel else []
        footer += [self.token_button, self.status]
        self.widget = widgets.VBox([self.text, widgets.HBox(footer, layout=widgets.Layout(align_items="center"))],
                                   _dom_classes=["pagednb-stream"])

        self._text_throttle = Throttle(TEXT_HZ, loop=loop)
        self._status_throttle = Throttle(STATUS_HZ, loop=loop)
        self._future: asyncio.Future[RequestOutput] = loop.create_future()
        self._future.add_done_callback(_mark_retrieved)  # a failure is shown in the view; no stray log
        self._task = loop.create_task(self._consume(), name=f"pagednb-stream-view-{self.request_id}")
        if token_view:
            self._show_tokens(True)

    # ---- the handle --------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Aborts the request in the engine (its KV blocks are freed at the next step boundary). Safe
        from any thread; the view shows finish_reason "abort" when the engine confirms."""
        if not self._future.done():
            self._llm.abort(self.request_id)

    @property
    def done(self) -> bool:
        return self._future.done()

    @property
    def latest(self) -> RequestOutput | None:
        """The newest output so far (None before the first token): the reply's progress, without awaiting."""
        return self._latest

    def result(self) -> asyncio.Future[RequestOutput]:
        """The final RequestOutput, as a future (raises the engine's error if the request failed)."""
        return self._future

    def __await__(self):
        return self._future.__await__()

    def __repr__(self) -> str:
        return f"StreamView(request_id={self.request_id!r}, {'done' if self.done else 'running'})"

    # ---- the background task -----------------------------------------------------------------------
    async def _consume(self) -> None:
        final = None
        try:
            async for out in self._stream:
                self._latest = final = out
                self._text_throttle.request(self._render_text)
                self._status_throttle.request(self._render_status)
        except asyncio.CancelledError:  # the loop is shutting down; the stream has aborted the request
            self._finish(final, "cancelled")
            self._future.cancel()
            raise
        except Exception as error:  # the engine failed this request (renders never raise: see _soft)
            self._finish(final, f"error: {error}")
            self._future.set_exception(error)
            return
        self._finish(final, None)
        self._future.set_result(final)

    def _finish(self, final: RequestOutput | None, problem: str | None) -> None:
        """The last render, always sent: full text, final status, Cancel disabled. Each part is soft,
        so the caller resolves the future whatever a widget or the on_final callback does."""
        self._soft(lambda: self._text_throttle.flush(self._render_text), "the final text")
        self._soft(lambda: self._status_throttle.flush(lambda: self._render_status(problem)), "the final status")
        self._text_throttle.close()
        self._status_throttle.close()
        BUDGET.take(1)
        self._soft(lambda: setattr(self.cancel_button, "disabled", True), "disabling Cancel")
        if self._showing_tokens:
            self._score_if_needed()  # the tokens that arrived since the toggle was pressed
        if self._on_final is not None:
            self._soft(lambda: self._on_final(final), "the on_final callback")

    # ---- rendering (loop thread only) --------------------------------------------------------------
    def _soft(self, action: Callable[[], object], what: str) -> bool:
        """Runs one rendering step; an error in it is logged (once per kind) and swallowed (False), never
        raised into the task that consumes the stream: a view's display must not decide whether its
        request finishes."""
        try:
            action()
            return True
        except Exception:
            self._log_failure(what)
            return False

    def _log_failure(self, what: str) -> None:
        """Logs the error being handled, once per kind of step."""
        if what not in self._failed:
            self._failed.add(what)
            logger.warning("pagednb view %s: %s failed; the view carries on", self.request_id, what, exc_info=True)

    def _wrap(self, body: str) -> str:
        return f'<div style="{self._text_css}">{body}</div>' if self._text_css else body

    def _show_tokens(self, on: bool) -> None:
        """The toggle, on the loop's thread: shows the token view (created the first time) or the text."""
        if on == self._showing_tokens:
            return
        if self.tokens is None:
            self.tokens = TokenView(self._text_css, self._loop)
            self.widget.children = (self.widget.children[0], self.tokens, *self.widget.children[1:])
            BUDGET.take(1)
        self._showing_tokens = on
        self.tokens.layout.display = None if on else "none"
        self.text.layout.display = "none" if on else None
        BUDGET.take(2)
        if on:
            self._score_if_needed()
        self._text_throttle.flush(self._render_text)  # the current state in the view just shown

    def _score_if_needed(self) -> None:
        """Starts scoring the reply if it has tokens without logprobs and no scoring is under way."""
        out = self._latest
        completion = out.outputs[0] if out is not None and out.outputs else None
        if completion is None or completion.logprobs is not None or self._scoring is not None:
            return
        if self._scored is None or len(self._scored.token_ids) < self._scorable(out):
            self._scoring = self._loop.create_task(self._score(out), name=f"pagednb-score-{self.request_id}")

    async def _score(self, out: RequestOutput) -> None:
        """The reply's token probabilities from one prefill of the prompt and the reply with prompt_logprobs:
        position p's entry is what the model gave token p, as `logprobs=` would have reported it. The
        scoring request must leave room for one token, so a reply that filled max_model_len loses its tail."""
        prompt = list(out.prompt_token_ids)
        reply = list(out.outputs[0].token_ids)[:self._scorable(out)]
        try:
            scored = await self._llm.agenerate({"prompt_token_ids": prompt + reply},
                                               SamplingParams(max_tokens=1, prompt_logprobs=DEFAULT_TOP_K))
            if scored.error is not None:
                raise scored.error
        except Exception:  # the engine refused or failed it: the token view keeps what it has (no retry)
            self._log_failure("scoring the tokens")
            return
        finally:
            self._scoring = None
        self._scored = CompletionOutput(0, "", reply, logprobs=scored.prompt_logprobs[len(prompt):])
        if self._showing_tokens:
            BUDGET.take(1)
            self._render_text()
        if self.done:
            self._score_if_needed()  # the reply ended while it was being scored: its tail too

    def _scorable(self, out: RequestOutput) -> int:
        """How many of the reply's tokens a scoring request can hold (it needs room for one token)."""
        return min(len(out.outputs[0].token_ids), max(0, self._llm.max_model_len - 1 - len(out.prompt_token_ids)))

    def _render_text(self) -> None:
        out = self._latest
        if self._showing_tokens:
            completion = out.outputs[0] if out and out.outputs else None
            if completion is not None and completion.logprobs is None:
                completion = self._scored  # a reply without logprobs: its scored tokens (or none yet)
            self._soft(lambda: self.tokens.update(completion), "rendering the tokens")
            return
        text = out.outputs[0].text if out and out.outputs else ""
        if not self._soft(lambda: setattr(self.text, "value", self._wrap(self._to_html(text))), "rendering the text"):
            self._to_html = plain_to_html  # from now on: a stream that flips between the two would flicker
            self._soft(lambda: setattr(self.text, "value", self._wrap(plain_to_html(text))), "the plain-text fallback")

    def _render_status(self, problem: str | None = None) -> None:
        def render() -> None:
            self.status.value = status_line(self._latest, time.monotonic() - self._started, problem)
        if not self._soft(render, "rendering the status"):
            out = self._latest
            reason = out.outputs[0].finish_reason if out is not None and out.outputs else None
            fallback = problem or reason or "generating…"
            self._soft(lambda: setattr(self.status, "value", fallback), "the status fallback")


def status_line(out: RequestOutput | None, elapsed: float, problem: str | None = None) -> str:
    """"12 tokens · 250.3 tok/s · TTFT 4 ms[ · prefix cache 32/40] · <finish_reason or 'generating'>"."""
    if out is None or not out.outputs:
        return problem or "waiting for the first token…"
    completion = out.outputs[0]
    n = len(completion.token_ids)
    parts = [f"{n} token{'' if n == 1 else 's'}", f"{n / max(elapsed, 1e-6):.1f} tok/s"]
    ttft = out.metrics.time_to_first_token if out.metrics is not None else None
    if ttft is not None:
        parts.append(f"TTFT {ttft * 1e3:.0f} ms")
    if out.num_cached_tokens:
        parts.append(f"prefix cache {out.num_cached_tokens}/{len(out.prompt_token_ids)} prompt tokens")
    parts.append(problem or completion.finish_reason or "generating…")
    return " · ".join(parts)


def _mark_retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _running_loop() -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError("pagednb's notebook views stream in the background on a running event loop: use them "
                           "in a Jupyter cell (or inside `async def` code run by asyncio)") from None


def stream(llm, prompt, sampling_params: SamplingParams | None = None, *, markdown: bool = True,
           token_view: bool = False, display: bool = True) -> StreamView:
    """Streams one reply into the cell (rendered Markdown, or plain text with markdown=False) with a
    Cancel button and a status line; returns at once. `out = await stream(...)` waits for the end.

    `prompt` is anything `llm.stream` takes, or a list of chat messages (templated like `llm.chat`).
    `token_view=True` shows the tokens coloured by probability as they arrive (the engine then computes
    logprobs for this request); otherwise the "Token probabilities" toggle scores the reply when pressed."""
    view = StreamView(llm, prompt, sampling_params, markdown=markdown, token_view=token_view)
    if display:
        view.show()
    return view
