"""The notebook experience in a real browser: JupyterLab (started here, on localhost) in Debian's Chromium,
driven by Playwright.

The chat and Cancel: opens notebooks/06_chat.ipynb, runs all its cells (Run > Run All Cells), types a
message into the chat and clicks Send, sees the reply stream into the history, clicks Cancel, and checks
that the stream stops with finish_reason "abort", that the pool view's used blocks fall to 0, that no cell
shows an error, and that the conversation is shown whole (the history scrolls; nothing is cut off).
Screenshots (after render, while streaming, after cancel; the pool view alone beside each) go to
test-artifacts/browser/<test>/, with the server's log.

Enter, autoscroll and the token view (06 again): Enter in the input sends; the history follows new
messages and the streaming reply to its bottom, also after the user scrolled it to the top; the
"Token probabilities" toggle shows one coloured span per token of the reply, and hovering one shows its
top-5 alternatives with their probabilities.

The pool view's final state (01_quickstart): after Run All, which stops the view right after its last
requests finish, the view shows the idle engine (used 0, running 0, no block owned), not a frame from
mid-run.

If the notebook's reply ends by itself before the Cancel click can land (a fast CPU: the embedded model
writes a ~75-token story at ~300 tok/s), the test adds one cell that slows each model step by 20 ms and
shows a second chat on the same LLM, and does Send/Cancel there (it says so in its output).

Never `playwright install` (it downloads browsers): the browser is /usr/bin/chromium (.ci/run installs it).
Skipped only when that browser or the playwright package is missing. PAGEDNB_BROWSER_NOTEBOOKS=<folder>
runs it on another folder's 06_chat.ipynb (for trying a notebook or widget change).
"""
import os
import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from browser_support import (BROWSER_TEST_MARKS, CHROMIUM, CHROMIUM_ARGS, REPO,  # noqa: E402
                             PlaywrightTimeoutError, copy_notebooks, parse_used, running_lab, sync_playwright,
                             wait_until)

pytestmark = BROWSER_TEST_MARKS

NOTEBOOK = "06_chat.ipynb"
ARTIFACTS = REPO / "test-artifacts" / "browser"
MESSAGE = "Tell me a story about a cat named Tom."

# Generous but bounded waits (seconds), sized for a 2-core CPU running the browser, the server and the
# kernel at once.
PAGE_LOAD_S = 60
RUN_ALL_S = 90     # kernel start, torch import, model load and every cell of the notebook
STREAM_S = 20      # the first streamed text after Send
SETTLE_S = 10      # "abort" shown and the pool back to 0 after Cancel

# Added as a last cell only if the notebook's reply ends before the Cancel click can land (a fast CPU, or
# the model meeting its end-of-sequence early): every model step of the notebook's LLM then sleeps 20 ms,
# and a second chat on the same LLM (the same widgets, 256 tokens ignoring EOS, a fresh conversation so
# prompt + max_tokens fits max_model_len) streams for seconds. One line, pasted as text (no auto-indent).
SLOW_CELL = ("import time, pagednb; from pagednb.notebook import chat as _chat; "
             "_llm = [v for v in list(globals().values()) if isinstance(v, pagednb.LLM)][0]; "
             "_runner = _llm.engine.runner; "
             "_runner.launch = (lambda f: lambda *a, **k: (time.sleep(0.02), f(*a, **k))[1])(_runner.launch); "
             "print('slowed model steps by 20 ms'); "
             "_slow_chat = _chat(_llm, sampling_params=pagednb.SamplingParams(max_tokens=256, ignore_eos=True))")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on a free localhost port serving a private copy of notebooks/ (nothing in the
    repository is written); shut down afterwards, its process group killed if it lingers."""
    src = Path(os.environ.get("PAGEDNB_BROWSER_NOTEBOOKS", REPO / "notebooks"))
    tmp = tmp_path_factory.mktemp("browser")
    root = copy_notebooks(src, tmp / "notebooks")
    with running_lab(root, tmp / "jupyter-state", ARTIFACTS) as server:
        yield server


@pytest.fixture
def page(tmp_path):
    """Debian's Chromium with a fresh profile (a new user-data dir), headless, 1400x1000."""
    console = []
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1400, "height": 1000})
        try:
            pg = context.pages[0] if context.pages else context.new_page()
            pg.set_default_timeout(30_000)
            pg.on("console", lambda m: m.type in ("error", "warning") and console.append(f"{m.type}: {m.text}"))
            pg.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            pg.console_messages = console
            yield pg
        finally:
            context.close()


class Shots:
    """Screenshots under test-artifacts/browser/<folder>/, printed as they are taken."""

    def __init__(self, page, folder: str):
        self.page = page
        self.folder = ARTIFACTS / folder
        self.folder.mkdir(parents=True, exist_ok=True)
        for old in self.folder.glob("*.png"):
            old.unlink()

    def __call__(self, name: str, scroll_to=None, pool=None) -> None:
        """The page (scrolled to `scroll_to` first), and the pool view's output alone as NAME_pool.png."""
        if scroll_to is not None and scroll_to.count():
            scroll_to.scroll_into_view_if_needed()
        self._save(name, self.page)
        if pool is not None:
            self._save(f"{name}_pool", pool)

    def _save(self, name, target) -> None:
        path = self.folder / f"{name}.png"
        target.screenshot(path=str(path))
        print(f"\n[browser test] screenshot: {path}", flush=True)


# ---- JupyterLab steps ----------------------------------------------------------------------------------
def kernel_status(page) -> str:
    """The status bar's kernel state ("Idle", "Busy", "Connecting", ...), or "" before it shows."""
    return page.evaluate("""() => {
        for (const el of document.querySelectorAll('.jp-StatusBar-Widget *')) {
            const m = /\\|\\s*(\\w[\\w ]*)$/.exec((el.textContent || '').trim());
            if (m && el.children.length === 0) return m[1];
        }
        return '';
    }""")


def open_notebook(page, lab, name):
    # ?reset: a fresh workspace, so the tabs an earlier test of this server opened are not restored
    # (their cells and widgets would be in the page too)
    page.goto(lab.url(f"/lab/tree/{name}?reset"))
    page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for(timeout=PAGE_LOAD_S * 1000)
    # Running cells before the kernel is connected races JupyterLab's session start (it can end with
    # "No Kernel"): wait for the status bar to say Idle.
    wait_until(lambda: kernel_status(page) == "Idle", PAGE_LOAD_S, 0.25, "the kernel to be connected and idle")
    page.evaluate("() => window.jupyterapp && window.jupyterapp.shell.collapseLeft()")  # room for the notebook


def run_all_cells(page):
    """Run > Run All Cells, from the menu bar as a user would."""
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Run All Cells")).click()


def code_prompts(page) -> list[str]:
    return [t.strip() for t in page.locator(".jp-CodeCell .jp-InputArea-prompt").all_inner_texts()]


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def errors_shown(page) -> list[str]:
    """Every error output of the notebook (`ename: evalue` and the traceback), from JupyterLab's own
    notebook model (the server runs with expose_app_in_browser); in the DOM an error and plain stderr
    look alike, so without the app only tracebacks are recognised."""
    errors = page.evaluate(r"""() => {
        const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
        if (!panel || !panel.content || !panel.content.model) return null;
        const cells = panel.content.model.cells, errors = [];
        for (let i = 0; i < cells.length; i++) {
            const outputs = cells.get(i).outputs;
            if (!outputs) continue;
            for (let j = 0; j < outputs.length; j++) {
                const o = outputs.get(j).toJSON();
                if (o.output_type === 'error')
                    errors.push(`cell ${i + 1}: ${o.ename}: ${o.evalue}\n` + (o.traceback || []).join('\n'));
            }
        }
        return errors;
    }""")
    if errors is None:
        errors = [t for t in page.locator(".jp-OutputArea-output").all_inner_texts()
                  if "Traceback (most recent call last)" in t]
    return [ANSI.sub("", e) for e in errors]


def wait_all_cells_ran(page, timeout):
    """Every code cell has an execution count and the kernel is idle; fails early on an error output."""
    def done():
        errors = errors_shown(page)
        assert not errors, "a cell failed:\n" + "\n---\n".join(e[-3000:] for e in errors)
        prompts = code_prompts(page)
        ran = prompts and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts)
        return ran and kernel_status(page) == "Idle"
    wait_until(done, timeout, 0.5, lambda: f"every code cell to run; prompts now: {' '.join(code_prompts(page))}, "
               f"kernel {kernel_status(page)!r}")


def add_cell_and_run(page, code):
    """A new code cell at the end of the notebook, typed and run in place (Ctrl+Enter: Shift+Enter on the
    last cell would add an empty, never-run cell below it)."""
    page.locator(".jp-Notebook .jp-Cell").last.locator(".jp-InputArea-prompt").click()  # select it
    page.keyboard.press("Escape")
    page.keyboard.press("b")  # insert a cell below, in command mode
    page.keyboard.press("Enter")  # edit mode
    page.keyboard.insert_text(code)
    page.keyboard.press("Control+Enter")


# ---- the chat widget --------------------------------------------------------------------------------
class Chat:
    """A chat widget of the notebook (a cell output holding `.pagednb-chat-input`; the first one, or the
    last) and the notebook's pool view."""

    def __init__(self, page, last: bool = False):
        self.page = page
        outputs = page.locator(".jp-OutputArea-output").filter(has=page.locator(".pagednb-chat-input"))
        self.output = outputs.last if last else outputs.first
        self.input = self.output.locator(".pagednb-chat-input input")
        self.send = self.output.locator("button.pagednb-send")
        # the chat's own Cancel, not one inside a reply in the history
        self.cancel = self.output.locator("button.pagednb-cancel:not(.pagednb-chat-history .pagednb-cancel)")
        self.history = self.output.locator(".pagednb-chat-history")
        self.used_label = page.locator(".pagednb-pool-used").first
        self.pool = page.locator(".jp-OutputArea-output").filter(has=page.locator(".pagednb-pool-used")).first

    def history_text(self) -> str:
        """The conversation as shown (status lines included)."""
        return self.history.inner_text()

    def look(self) -> dict:
        """One observation in one round trip: the length of the history's messages (without the status
        lines, whose token counts and tok/s change even when no text arrives), the number of replies (status
        lines), the latest reply's status line (".pagednb-status"; "" before one shows) and its finish
        reason, the history's last entry, and the pool view's used blocks."""
        seen = self.history.evaluate("""el => {
            const copy = el.cloneNode(true);
            copy.querySelectorAll('.pagednb-status').forEach(s => s.remove());
            const statuses = el.querySelectorAll('.pagednb-status');
            const used = document.querySelector('.pagednb-pool-used');
            const last = el.lastElementChild;
            return {chars: copy.textContent.length, replies: statuses.length,
                    status: statuses.length ? statuses[statuses.length - 1].textContent : '',
                    last: last ? last.textContent.trim() : '',
                    used: used ? used.textContent : ''};
        }""")
        seen["used"] = parse_used(seen["used"])
        seen["reason"] = finish_reason(seen["status"])
        return seen

    def used(self) -> int | None:
        return parse_used(self.used_label.inner_text())

    def squeezed_entries(self) -> list[str]:
        """History entries shown cut off: taller than the box they get (the history should scroll, with
        every message and status line whole, rather than squeeze its entries to fit its max height)."""
        return self.history.evaluate("""el => [...el.children]
            .filter(c => c.scrollHeight > c.clientHeight + 1)
            .map(c => `${c.clientHeight}px of ${c.scrollHeight}px: ${c.textContent.trim().slice(0, 60)}`)""")

    def status(self) -> str:
        """The latest reply's status line (".pagednb-status" in the history), "" before one shows."""
        return self.look()["status"]


def finish_reason(status: str) -> str | None:
    """The finish reason ending a status line ("... · 250 tok/s · abort"); None while generating."""
    m = re.search(r"(?:^|·)\s*(abort|length|stop|error|cancelled)\b[^·]*$", status.strip())
    return m.group(1) if m else None


def send_and_watch(chat, message) -> tuple[list[int], int, dict]:
    """Sends `message` and watches the history every ~50 ms: returns the messages' text length at each
    observation, the largest used-block count seen and the last observation. Stops once the text has
    grown twice in a row with blocks in use, or the new reply has ended."""
    before = chat.look()
    chat.input.fill(message)
    chat.send.click()

    def started():  # a new reply (status line) below the user's message, with text or already ended
        s = chat.look()
        assert not s["last"].lower().startswith("error"), f"the chat answered with an error: {s['last']!r}"
        new = s["replies"] > before["replies"]
        return s if new and (s["chars"] > before["chars"] + len(message) or s["reason"]) else None

    first = wait_until(started, STREAM_S, 0.02, "the user's message and a first piece of the reply in the history")
    lengths, max_used, seen = [first["chars"]], first["used"] or 0, first
    deadline = time.monotonic() + STREAM_S
    while time.monotonic() < deadline and not seen["reason"]:
        time.sleep(0.05)
        seen = chat.look()
        lengths.append(seen["chars"])
        max_used = max(max_used, seen["used"] or 0)
        if len(lengths) >= 3 and lengths[-3] < lengths[-2] < lengths[-1] and max_used > 0:
            break
    return lengths, max_used, seen


def stream_then_cancel(chat, shot) -> dict | str:
    """Send, see the reply stream in, click Cancel. Returns what was seen, or a string saying why this
    attempt could not test Cancel (the reply ended by itself before the click landed)."""
    lengths, max_used, seen = send_and_watch(chat, MESSAGE)
    assert seen["reason"] in (None, "length", "stop"), f"the reply ended with {seen['status']!r} before Cancel"
    if seen["reason"]:
        return f"the reply ended by itself ({seen['status']!r}; message lengths {lengths})"
    assert len(lengths) >= 3 and lengths[-3] < lengths[-2] < lengths[-1], (
        f"the reply did not grow twice in a row within {STREAM_S} s: message lengths {lengths}")
    assert max_used > 0, "the pool view never showed used blocks while the reply streamed"

    shot("02_streaming", scroll_to=chat.history.locator(".pagednb-stream-text").last, pool=chat.pool)
    try:
        chat.cancel.click(timeout=5_000)  # disabled once the reply has ended: then the click cannot land
    except PlaywrightTimeoutError:
        if chat.look()["reason"] in ("length", "stop"):
            return f"the reply ended by itself before Cancel was clicked ({chat.status()!r})"
        raise
    t_click = time.monotonic()
    reason = wait_until(lambda: chat.look()["reason"], SETTLE_S, 0.05,
                        lambda: f"a finish reason in the reply's status after Cancel (status: {chat.status()!r})")
    if reason in ("length", "stop"):  # it ended by itself between the last look and the click
        return f"the reply ended by itself as Cancel was clicked ({chat.status()!r})"
    assert reason == "abort", f"after Cancel the reply's status is {chat.status()!r}, not 'abort'"
    abort_s = time.monotonic() - t_click
    settled = chat.history_text()
    time.sleep(1.0)
    assert chat.history_text() == settled, "the history still changed 1 s after the reply was aborted"
    wait_until(lambda: chat.used() == 0, SETTLE_S, 0.1,
               lambda: f"the pool view's used blocks to fall to 0 (label: {chat.used_label.inner_text()!r})")
    shot("03_cancelled", scroll_to=chat.history.locator(".pagednb-status").last, pool=chat.pool)
    return {"lengths": lengths, "max_used": max_used, "used_after": chat.used(), "abort_s": abort_s,
            "status": chat.status()}


def test_chat_streams_and_cancel_stops_it_in_jupyterlab(lab, page):
    t0 = time.monotonic()
    notebook = lab.root_dir / NOTEBOOK
    assert notebook.exists(), f"{NOTEBOOK} is missing from {lab.root_dir} (the tutorial notebook under test)"
    shot = Shots(page, "chat_cancel")
    try:
        # 1. open the notebook, run all its cells, see the widgets
        open_notebook(page, lab, NOTEBOOK)
        run_all_cells(page)
        chat = Chat(page)
        chat.input.wait_for(state="visible", timeout=RUN_ALL_S * 1000)
        chat.used_label.wait_for(state="visible", timeout=RUN_ALL_S * 1000)
        wait_all_cells_ran(page, RUN_ALL_S)
        assert chat.send.is_visible() and chat.cancel.count() == 1 and chat.history.count() == 1
        assert page.locator(".pagednb-block-map").first.is_visible()
        assert chat.used() is not None, f"no 'used N' in the pool view: {chat.used_label.inner_text()!r}"
        shot("01_rendered", scroll_to=chat.output, pool=chat.pool)
        print(f"[browser test] rendered after {time.monotonic() - t0:.1f} s", flush=True)

        # 2-3. send a message, see the reply stream in, Cancel: the stream stops with "abort" and the
        # pool's used blocks fall to 0
        seen = stream_then_cancel(chat, shot)
        if isinstance(seen, str):
            # Fallback, only when the notebook's own reply ended before Cancel could land: slow the model
            # step by 20 ms from an added cell, which also shows a second chat on the same LLM; try there.
            print(f"\n[browser test] {seen}; falling back to a slowed model step and a second chat", flush=True)
            shot("02_ended_before_cancel", scroll_to=chat.output)
            add_cell_and_run(page, SLOW_CELL)
            page.get_by_text("slowed model steps by 20 ms").wait_for(timeout=30_000)
            wait_all_cells_ran(page, 30)
            assert page.locator(".pagednb-chat-input").count() == 2, "the fallback cell showed no second chat"
            chat = Chat(page, last=True)
            seen = stream_then_cancel(chat, shot)
            assert not isinstance(seen, str), f"even with a slowed model step: {seen}"
        assert seen["used_after"] == 0 < seen["max_used"]
        errors = errors_shown(page)
        assert not errors, "an error output appeared:\n" + "\n---\n".join(errors)
        lengths = seen["lengths"]
        print(f"[browser test] streamed {lengths[-1] - lengths[0]} chars over {len(lengths)} observations; "
              f"used blocks {seen['max_used']} -> {seen['used_after']}; 'abort' shown {seen['abort_s']:.2f} s "
              f"after the Cancel click; status: {seen['status']!r}; total {time.monotonic() - t0:.1f} s", flush=True)

        # 4. what the user sees: every message and status line of the conversation whole (the history
        # box scrolls), so the "abort" above is on screen, not cut off
        chats = [Chat(page)] + ([Chat(page, last=True)] if page.locator(".pagednb-chat-input").count() > 1 else [])
        squeezed = [entry for c in chats for entry in c.squeezed_entries()]
        assert not squeezed, ("the chat history squeezes its entries to fit its max height instead of "
                              "scrolling, cutting messages and status lines off (see 03_cancelled.png):\n"
                              + "\n".join(squeezed))
    except BaseException:
        report_failure(page, lab, shot)
        raise


def report_failure(page, lab, shot) -> None:
    """A screenshot of the page, the browser console and the server log's tail, for the failure report."""
    try:
        shot("failure")
    except Exception:
        pass
    tail = "\n".join(page.console_messages[-20:])
    print(f"\n[browser test] browser console (errors/warnings):\n{tail}\n[browser test] server log tail:\n"
          f"{lab.log_tail(3000)}", flush=True)


def run_notebook(page, lab, name):
    """Opens notebooks/<name> and runs all its cells; returns once every cell ran, none failing."""
    assert (lab.root_dir / name).exists(), f"{name} is missing from {lab.root_dir}"
    open_notebook(page, lab, name)
    run_all_cells(page)
    wait_all_cells_ran(page, RUN_ALL_S)


# ---- Enter, autoscroll, the token view ----------------------------------------------------------------
def scroll_state(chat) -> dict:
    """How far the history is from its bottom (px), whether it overflows, and its last entry's text."""
    return chat.history.evaluate("""el => ({
        gap: el.scrollHeight - el.scrollTop - el.clientHeight, overflows: el.scrollHeight > el.clientHeight + 50,
        last: el.lastElementChild ? el.lastElementChild.textContent.trim() : ''})""")


def test_enter_sends_the_history_follows_and_the_token_view_shows_alternatives(lab, page):
    shot = Shots(page, "chat_enter_tokens")
    try:
        run_notebook(page, lab, NOTEBOOK)
        chat = Chat(page)
        chat.input.wait_for(state="visible")

        # Enter sends (no click on Send), and the history, scrolled to the top first, follows the new
        # message and the reply down to its bottom
        chat.history.evaluate("el => { el.scrollTop = 0; }")
        before = chat.look()
        message = "Tell me a story about a bear named Rosie."  # a story: names the model is unsure of
        chat.input.fill(message)
        chat.input.press("Enter")
        wait_until(lambda: chat.look()["replies"] > before["replies"], STREAM_S, 0.05,
                   "Enter in the chat input to send the message (a new reply in the history)")
        assert chat.input.input_value() == "", "the input was not cleared by Enter"
        gaps = []
        while not chat.look()["reason"]:
            gaps.append(scroll_state(chat)["gap"])
            time.sleep(0.05)
            assert len(gaps) < STREAM_S * 20, "the reply did not end"
        wait_until(lambda: scroll_state(chat)["gap"] < 30, 5, 0.05,
                   lambda: f"the history to follow the reply to its bottom ({scroll_state(chat)})")
        state = scroll_state(chat)
        assert state["overflows"], "the history does not overflow its box: the autoscroll check proves nothing"
        assert message in chat.history_text()
        assert max(gaps, default=0) < 200, f"the history fell behind the streaming reply: gaps {gaps}"
        shot("01_followed", scroll_to=chat.output)

        # the token view of that reply: one span per token, coloured, and the alternatives on hover
        reply = chat.history.locator(".pagednb-stream").last
        tokens = int(re.match(r"(\d+) token", reply.locator(".pagednb-status").inner_text()).group(1))
        reply.locator("button.pagednb-token-toggle").click()
        spans = reply.locator(".pagednb-token")
        wait_until(lambda: spans.count() == tokens, 10, 0.1,
                   lambda: f"{tokens} token spans in the token view (now {spans.count()})")
        assert not reply.locator(".pagednb-stream-text").is_visible(), "the text still shows beside the tokens"
        colours = {spans.nth(i).evaluate("el => getComputedStyle(el).backgroundColor") for i in range(tokens)}
        assert len(colours) > 1, f"every token has the same colour {colours}: not coloured by probability"
        target = spans.nth(min(2, tokens - 1))
        target.hover()
        tip = reply.locator(".pagednb-token-tip")
        tip.wait_for(state="visible", timeout=5_000)
        rows = tip.locator("tr").all_inner_texts()
        assert len(rows) == 5 and all(re.search(r"\d%", r) for r in rows), f"the tooltip's alternatives: {rows}"
        head = tip.locator(".pagednb-token-tip-head").inner_text()
        shown = target.inner_text().replace(" ", "\u2423").replace("\n", "\u21b5")
        assert head.startswith(shown), f"the tooltip {head!r} is not about the hovered token {shown!r}"
        shot("02_token_view", scroll_to=reply)
        reply.locator("button.pagednb-token-toggle").click()
        reply.locator(".pagednb-stream-text").wait_for(state="visible", timeout=5_000)
        assert not errors_shown(page)
    except BaseException:
        report_failure(page, lab, shot)
        raise


# ---- the pool view's final state ------------------------------------------------------------------------
def test_the_pool_view_shows_the_final_state_after_run_all(lab, page):
    shot = Shots(page, "pool_final")
    try:
        run_notebook(page, lab, "01_quickstart.ipynb")
        pool = page.locator(".jp-OutputArea-output").filter(has=page.locator(".pagednb-pool-used")).first
        used = pool.locator(".pagednb-pool-used").inner_text()
        activity = pool.locator(".pagednb-pool-activity").inner_text()
        owned = pool.locator(".pagednb-block-map i[class^='o']").count()
        shot("01_after_run_all", scroll_to=pool, pool=pool)
        assert parse_used(used) == 0, f"the pool view is frozen mid-run after Run All: {used!r}"
        assert "running 0 · waiting 0" in activity, f"the pool view is frozen mid-run: {activity!r}"
        assert owned == 0, f"the block map still draws {owned} blocks owned by requests"
        legend = pool.locator(".pagednb-legend").inner_text()
        assert "cached" in legend and "free" in legend, legend
    except BaseException:
        report_failure(page, lab, shot)
        raise
