"""`step_view(llm)`: a step-through debugger for the engine — pause it, queue requests, press Step and
see what the scheduler decided and why (engine/step_report.py has the numbers).

The widget is an anywidget (static/step_view.js), so it renders in JupyterLab, Notebook 7, VS Code,
Colab and marimo. Its buttons send messages to this object, which drives the public debugging API of
the LLM: `pause()`, `debug_step()`, `resume()`, `on_step()`. Requests queue from anywhere while
paused: the widget's own "Add" box, `llm.stream(...)` and the stream and chat views of other cells
(a synchronous `llm.generate` refuses instead: it would hold the kernel, so no click could reach it; a
cell awaiting a request of its own holds the kernel likewise, until it is interrupted).

The view listens to steps only while the engine is paused, so "Run" costs the running engine nothing;
each report is drawn through a 30 Hz throttle with a final flush, as every other view.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from pathlib import Path

import anywidget
import traitlets

from pagednb.engine.step_report import StepReport
from pagednb.notebook.display import Displayable
from pagednb.notebook.throttle import BUDGET, TEXT_HZ, Throttle
from pagednb.outputs import RequestOutput
from pagednb.sampling_params import RequestOutputKind, SamplingParams

STATIC = Path(__file__).parent / "static"
LABEL_CHARS = 40  # a request's prompt is shown cut to this many characters
MAX_FINISHED = 20  # finished requests of the widget's own kept on display


class StepWidget(anywidget.AnyWidget):
    """The widget: `report` is the last StepReport (as JSON), `status` the engine's state around it."""

    _esm = STATIC / "step_view.js"
    _css = STATIC / "step_view.css"
    report = traitlets.Dict().tag(sync=True)
    status = traitlets.Dict().tag(sync=True)


class StepView(Displayable):
    """The step debugger of one LLM. `step()`, `run()`, `pause()` and `add()` do what the buttons do."""

    def __init__(self, llm, pause: bool = True, max_tokens: int = 16) -> None:
        self._llm = llm
        self.max_tokens = max_tokens
        self.last_report: StepReport | None = None
        self.finished: list[dict] = []  # the widget's own requests, once they ended
        self.message = ""
        self._stop_listening = None
        self._loop_thread = threading.get_ident()
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            self._throttle: Throttle | None = Throttle(TEXT_HZ, cost=2, loop=self._loop)
        except RuntimeError:  # a script: every report is drawn at once
            self._loop, self._throttle = None, None
        self.widget = StepWidget()
        self.widget.on_msg(self._on_message)
        if pause:
            self.pause()
        else:
            self._draw()

    # ---- the buttons -----------------------------------------------------------------------------
    def pause(self) -> None:
        self._llm.pause()
        self._listen(True)
        self.message = "paused: Step advances one step, Run resumes"
        self._draw()

    def step(self) -> StepReport:
        """One engine step (pausing the engine first if it runs); returns its report."""
        if not self._llm.paused:
            self.pause()
        report = self._llm.debug_step()  # drawn by the listener
        self._flush()
        return report

    def run(self) -> None:
        """Back to normal background stepping (started on the kernel's loop if nothing started it)."""
        self._listen(False)
        self._llm.resume()
        if self._loop is not None:
            self._llm.driver.ensure_background_loop()
        self.message = "running"
        self._draw()

    def add(self, prompt: str, max_tokens: int | None = None) -> str:
        """Queues a request (its outputs are kept by this view); returns its id."""
        params = SamplingParams(temperature=0, max_tokens=self.max_tokens if max_tokens is None else max_tokens,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        req = self._llm.engine.make_request(None, prompt, params)
        self._llm.driver.submit(req, self._on_output)
        if not self._llm.paused and self._loop is not None:
            self._llm.driver.ensure_background_loop()
        self.message = f"added {req.request_id!r}: waiting for the next step"
        self._draw()
        return req.request_id

    def close(self) -> None:
        """Stops listening (the engine's state is left as it is) and closes the widget."""
        self._listen(False)
        if self._throttle is not None:
            self._throttle.close()
        self.widget.close()

    def _on_message(self, _widget, content: dict, _buffers) -> None:
        """A click in the widget; a refusal (bad input, a closed engine) is shown there, not raised."""
        action = content.get("action")
        try:
            if action == "step":
                self.step()
            elif action == "run":
                self.run()
            elif action == "pause":
                self.pause()
            elif action == "add":
                self.add(str(content.get("prompt", "")), content.get("max_tokens"))
        except Exception as error:
            self.message = f"{action}: {error}"
            self._draw()

    # ---- engine callbacks --------------------------------------------------------------------------
    def _listen(self, on: bool) -> None:
        if on and self._stop_listening is None:
            self._stop_listening = self._llm.on_step(self._on_report)
        elif not on and self._stop_listening is not None:
            self._stop_listening()
            self._stop_listening = None

    def _on_report(self, report: StepReport) -> None:
        """On the stepping thread: keep the report, draw it on the loop's."""
        self.last_report = report
        if self._throttle is None:
            self._draw()
        elif threading.get_ident() == self._loop_thread:
            self._throttle.request(self._draw)
        else:
            self._loop.call_soon_threadsafe(self._throttle.request, self._draw)

    def _on_output(self, out: RequestOutput) -> None:
        if out.finished:
            completion = out.outputs[0] if out.outputs else None
            self.finished = ([{"request_id": out.request_id,
                               "reason": "error" if out.error else (completion.finish_reason if completion else ""),
                               "text": str(out.error) if out.error else (completion.text if completion else "")}]
                             + self.finished)[:MAX_FINISHED]

    # ---- drawing -------------------------------------------------------------------------------------
    def _flush(self) -> None:
        if self._throttle is not None:
            self._throttle.flush(self._draw)

    def _draw(self) -> None:
        if self._throttle is None:
            BUDGET.take(2)
        self.widget.report = report_json(self.last_report, self._labels()) if self.last_report else {}
        self.widget.status = self._status()

    def _labels(self) -> dict[str, str]:
        """Each request's prompt, shortened, for the tables (requests still known to the scheduler)."""
        requests = self._llm.engine.scheduler.requests
        report = self.last_report
        ids = {row.request_id for row in report.rows} | set(report.block_tables) | set(report.waiting)
        return {rid: _short(requests[rid].prompt) for rid in ids
                if rid in requests and requests[rid].prompt}

    def _status(self) -> dict:
        stats = self._llm.stats()
        return {"paused": self._llm.paused, "message": self.message, "running": stats["running"],
                "waiting": stats["waiting"], "used_blocks": stats["used_blocks"],
                "num_blocks": stats["num_blocks"], "finished": self.finished}


def report_json(report: StepReport, labels: dict[str, str]) -> dict:
    """The report as the browser receives it (tuples become lists)."""
    data = dataclasses.asdict(report)
    data["labels"] = labels
    data["summary"] = report.summary()
    return json.loads(json.dumps(data))


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= LABEL_CHARS else text[:LABEL_CHARS - 1] + "…"


def step_view(llm, *, pause: bool = True, max_tokens: int = 16, display: bool = True) -> StepView:
    """Shows the step debugger of `llm`; pauses the engine unless pause=False. `max_tokens`: what the
    widget's Add box asks for."""
    view = StepView(llm, pause=pause, max_tokens=max_tokens)
    if display:
        view.show()
    return view
