"""`chat()`: a multi-turn chat in a cell — history as bubbles, an input box, Send and Cancel.

Each turn is one request whose prompt is the tokenizer's chat template applied to the whole
conversation so far. The previous turns' tokens are therefore an exact prefix of the new prompt, and
the engine's prefix cache serves them: a follow-up's time to first token (shown under every reply)
stays small however long the conversation grows.

Enter in the input sends, like Send (the text box's "submit" message). The history follows new
messages and a streaming reply to its bottom (autoscroll.py), unless the user scrolled up to read.

Button handlers only hand work to the event loop (`call_soon_threadsafe`), since ipykernel 7.0-7.3 may
run them on another thread and a stream must be started on the loop's own thread.
"""
from __future__ import annotations

import threading

import ipywidgets as widgets

from pagednb.chat_template import apply_chat_template, check_chat_template
from pagednb.notebook.autoscroll import AutoScroll
from pagednb.notebook.display import Displayable
from pagednb.notebook.markdown import escape
from pagednb.notebook.stream_view import DEFAULT_MAX_TOKENS, StreamView, _running_loop
from pagednb.notebook.throttle import BUDGET
from pagednb.outputs import RequestOutput
from pagednb.sampling_params import SamplingParams

_BUBBLE = "border-radius:12px;padding:6px 12px;max-width:80%;"
USER_CSS = _BUBBLE + "background:#dbeafe;margin-left:auto;white-space:pre-wrap;"
ASSISTANT_CSS = _BUBBLE + "background:#f3f4f6;"


class ChatView(Displayable):
    """The chat widget. `history` holds the conversation as chat messages (system prompt first)."""

    def __init__(self, llm, system_prompt: str | None = None, sampling_params: SamplingParams | None = None) -> None:
        self._loop = _running_loop()
        self._loop_thread = threading.get_ident()
        self._llm = llm
        self._tokenizer = llm.get_tokenizer()
        check_chat_template(self._tokenizer)
        self._params = sampling_params
        self.history: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.turn: StreamView | None = None  # the latest assistant turn

        # display "block" so a long history scrolls; a flex column would squeeze the bubbles instead
        self.history_box = widgets.VBox([], layout=widgets.Layout(max_height="480px", overflow="auto", display="block"),
                                       _dom_classes=["pagednb-chat-history"])
        if system_prompt:
            self.history_box.children = (_bubble(f"<i>system:</i> {escape(system_prompt)}", _BUBBLE + "background:#fef3c7;"),)
        self.input = widgets.Text(placeholder="Type a message and press Enter",
                                  layout=widgets.Layout(flex="1 1 auto", width="auto"),
                                  _dom_classes=["pagednb-chat-input"])
        self.send_button = widgets.Button(description="Send", icon="paper-plane", button_style="primary",
                                          layout=widgets.Layout(width="auto"),
                                          _dom_classes=["pagednb-send"])
        self.cancel_button = widgets.Button(description="Cancel", icon="stop", button_style="warning",
                                            disabled=True, layout=widgets.Layout(width="auto"),
                                            _dom_classes=["pagednb-cancel"])
        self.send_button.on_click(lambda _button: self._loop.call_soon_threadsafe(self._send_from_input))
        self.input.on_msg(self._on_input_message)
        self.cancel_button.on_click(lambda _button: self.cancel())
        follow = AutoScroll(container="pagednb-chat", target="pagednb-chat-history")
        self.widget = widgets.VBox([self.history_box, widgets.HBox([self.input, self.send_button, self.cancel_button]),
                                    follow], _dom_classes=["pagednb-chat"])

    @property
    def busy(self) -> bool:
        return self.turn is not None and not self.turn.done

    def send(self, text: str) -> StreamView:
        """Adds a user message and streams the reply; returns the reply's handle (`await` it for the
        final output). Call on the loop's thread (any cell); one reply streams at a time."""
        if threading.get_ident() != self._loop_thread:
            raise RuntimeError("ChatView.send() must run on the event loop's thread (a cell); the Send button may "
                               "be clicked from anywhere")
        if self.busy:
            raise RuntimeError("a reply is still streaming: await it or cancel() it first")
        self.history.append({"role": "user", "content": text})
        try:
            ids = apply_chat_template(self._tokenizer, self.history)
            # a reader who left the token view on gets the next reply's tokens live
            token_view = self.turn is not None and self.turn.token_button.value
            turn = StreamView(self._llm, {"prompt_token_ids": ids}, self._params_for(len(ids)), show_cancel=False,
                              text_css=ASSISTANT_CSS, on_final=self._on_final, token_view=token_view)
        except Exception:
            self.history.pop()  # the turn never started: the conversation stays as it was
            raise
        self.turn = turn
        BUDGET.take(3)
        self.history_box.children = (*self.history_box.children, _bubble(escape(text), USER_CSS), turn.widget)
        self.send_button.disabled = True
        self.cancel_button.disabled = False
        return turn

    def _params_for(self, num_prompt_tokens: int):
        """The turn's sampling params, its max_tokens shrunk to the room left in max_model_len."""
        room = self._llm.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(f"the conversation is full: {num_prompt_tokens} tokens of max_model_len "
                             f"{self._llm.max_model_len}; start a new chat()")
        params = self._params.clone() if self._params is not None else SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
        params.max_tokens = min(params.max_tokens or room, room)
        return params

    def cancel(self) -> None:
        """Stops the streaming reply (safe from any thread); what it said so far stays in the history."""
        turn = self.turn
        if turn is not None:
            turn.cancel()

    def _on_input_message(self, _widget, content: dict, _buffers) -> None:
        """Enter in the text box: the browser sends {"event": "submit"} (after the typed value)."""
        if content.get("event") == "submit":
            self._loop.call_soon_threadsafe(self._send_from_input)

    def _send_from_input(self) -> None:
        text = self.input.value.strip()
        if not text or self.busy:
            return
        self.input.value = ""
        BUDGET.take(1)
        try:
            self.send(text)
        except Exception as error:  # e.g. the conversation outgrew max_model_len: say so in the chat
            self.history_box.children = (*self.history_box.children,
                                         _bubble(f"<b>error:</b> {escape(str(error))}", ASSISTANT_CSS + "color:#b91c1c;"))

    def _on_final(self, out: RequestOutput | None) -> None:
        """Runs (on the loop) when the reply ends, before anyone awaiting it resumes. Whatever happens
        here, the chat goes back to idle: Send on, Cancel off."""
        try:
            text = out.outputs[0].text if out is not None and out.outputs else ""
            self.history.append({"role": "assistant", "content": text})
        finally:
            BUDGET.take(2)
            self.send_button.disabled = False
            self.cancel_button.disabled = True

    def __repr__(self) -> str:
        return f"ChatView({len(self.history)} messages{', streaming' if self.busy else ''})"


def _bubble(html: str, css: str) -> widgets.HTML:
    bubble = widgets.HTML(f'<div style="{css}">{html}</div>', layout=widgets.Layout(width="100%"),
                          _dom_classes=["pagednb-chat-bubble"])
    return bubble


def chat(llm, system_prompt: str | None = None, sampling_params: SamplingParams | None = None, *,
         display: bool = True) -> ChatView:
    """Shows a chat with `llm` in the cell; type and press Send, or call `view.send(text)`."""
    view = ChatView(llm, system_prompt, sampling_params)
    if display:
        view.show()
    return view
