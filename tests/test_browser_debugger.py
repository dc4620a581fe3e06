"""The step debugger in a real browser: JupyterLab (started here, on localhost) in Debian's Chromium, driven
by Playwright.

A notebook made for the test queues three requests on a small engine (a 32-token budget, so the third
prompt is split into chunks) and opens `step_view(llm)`, which pauses the engine. The test clicks Step
three times; after each click the widget's batch table must show the rows of the step the engine just
ran — checked against the StepReports the kernel recorded (printed by a last cell) and against the
scheduler's rule for this workload worked out by hand — and the tables of the three steps must differ.
Screenshots of the widget after each step, and of the page on failure, go to
test-artifacts/browser/step_debugger/, with the server's log.

Never `playwright install`: the browser is /usr/bin/chromium. Skipped only when it or playwright is missing.
"""
import json
import re
import sys
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from browser_support import (BROWSER_TEST_MARKS, CHROMIUM, CHROMIUM_ARGS, REPO, running_lab,  # noqa: E402
                             sync_playwright, wait_until)

pytestmark = BROWSER_TEST_MARKS

ARTIFACTS = REPO / "test-artifacts" / "browser" / "step_debugger"
PAGE_LOAD_S = 60
RUN_ALL_S = 90
STEP_S = 20

SETUP = """\
from pagednb import LLM, SamplingParams
from pagednb.notebook import step_view

llm = LLM(None, num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=3)
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
for rid, n in [("a", 20), ("b", 9), ("c", 12)]:
    llm.engine.add_request(rid, {"prompt_token_ids": list(range(10, 10 + n))}, params)
reports = []
stop_recording = llm.on_step(reports.append)
view = step_view(llm)"""
PRINT_REPORTS = ("import json; print('REPORTS' + json.dumps([[[r.request_id, r.kind, f'{r.start}\\u2013"
                 "{r.start + r.num_tokens}', str(r.num_tokens)] for r in rep.rows] for rep in reports]))")
# The scheduler's rule for this workload (budget 32, running requests first): a and b's prompts whole and
# c's first 3 tokens; then a and b decode while c's last 9 prompt tokens run; then three decodes.
BY_HAND = [
    [["a", "prefill", "0–20", "20"], ["b", "prefill", "0–9", "9"], ["c", "prefill", "0–3", "3"]],
    [["a", "decode", "20–21", "1"], ["b", "decode", "9–10", "1"], ["c", "prefill", "3–12", "9"]],
    [["a", "decode", "21–22", "1"], ["b", "decode", "10–11", "1"], ["c", "decode", "12–13", "1"]],
]


@pytest.fixture
def lab(tmp_path):
    root = tmp_path / "notebooks"
    root.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SETUP)],
                                  metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}})
    nbformat.write(nb, root / "debugger.ipynb")
    with running_lab(root, tmp_path / "jupyter-state", ARTIFACTS) as server:
        yield server


@pytest.fixture
def page(tmp_path):
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1400, "height": 1000})
        try:
            pg = context.pages[0] if context.pages else context.new_page()
            pg.set_default_timeout(30_000)
            yield pg
        finally:
            context.close()


def kernel_idle(page) -> bool:
    return page.evaluate("""() => {
        const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
        const kernel = panel && panel.sessionContext && panel.sessionContext.session &&
                       panel.sessionContext.session.kernel;
        return !!kernel && kernel.status === 'idle';
    }""")


def run_cell(page, code: str) -> None:
    """Types `code` into a new cell at the end and runs it (Ctrl+Enter), as a user would."""
    page.locator(".jp-Notebook .jp-Cell").last.locator(".jp-InputArea-prompt").click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")
    page.keyboard.press("Enter")
    page.keyboard.insert_text(code)
    page.keyboard.press("Control+Enter")


def batch_rows(widget) -> list[list[str]]:
    """The batch table as shown: [request, kind, tokens, n] per row."""
    return widget.evaluate("""el => [...el.querySelectorAll('.pagednb-step-batch tbody tr')].map(
        tr => [...tr.cells].slice(0, 4).map(td => td.textContent.trim()))""")


def test_step_three_times_and_the_batch_table_follows_the_engine(lab, page):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in ARTIFACTS.glob("*.png"):
        old.unlink()
    try:
        page.goto(lab.url("/lab/tree/debugger.ipynb"))
        page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for(timeout=PAGE_LOAD_S * 1000)
        wait_until(lambda: kernel_idle(page), PAGE_LOAD_S, 0.25, "the kernel to be connected and idle")
        page.locator(".jp-Notebook .jp-Cell").first.locator(".jp-InputArea-prompt").click()
        page.keyboard.press("Control+Enter")
        widget = page.locator(".pagednb-step")
        widget.wait_for(timeout=RUN_ALL_S * 1000)
        assert "paused" in widget.locator(".pagednb-step-state").inner_text()
        assert widget.locator(".pagednb-step-batch").count() == 0  # nothing ran yet

        shown = []
        for i in range(3):
            widget.locator("button.pagednb-step-step").click()
            summary = widget.locator(".pagednb-step-summary")
            wait_until(lambda: summary.count() and re.match(rf"step {i + 1}:", summary.inner_text()), STEP_S, 0.1,
                       f"the report of step {i + 1}")
            shown.append(batch_rows(widget))
            widget.screenshot(path=str(ARTIFACTS / f"after_step_{i + 1}.png"))

        wait_until(lambda: kernel_idle(page), STEP_S, 0.25, "the kernel to be idle")
        run_cell(page, PRINT_REPORTS)
        printed = page.locator(".jp-OutputArea-output", has_text="REPORTS")
        printed.wait_for(timeout=STEP_S * 1000)
        recorded = json.loads(printed.inner_text().strip().removeprefix("REPORTS"))
        assert shown == recorded, "the widget's tables are not the engine's steps"
        assert recorded == BY_HAND
        assert shown[0] != shown[1] != shown[2]
        wait_until(lambda: "waiting 0" in widget.locator(".pagednb-step-state").inner_text()
                   and "running 3" in widget.locator(".pagednb-step-state").inner_text(), STEP_S, 0.1,
                   "the status line to show the engine's state")
    except BaseException:
        page.screenshot(path=str(ARTIFACTS / "failure.png"), full_page=True)
        raise
