"""Every ```python block of README.md runs as written, in order, in one namespace (as a reader pasting
them into one notebook would), on the CPU with the embedded model, inside a running event loop (the
blocks use top-level `await` and `async for`, as notebook cells may).

A block not meant to run here (a GPU-only feature, say) is preceded by the line
`<!-- readme-test: skip (<why>) -->`; the reason is required, and there should be few of them.
A block that prints must print something: the async snippet once printed nothing (a raw prompt, which
the embedded chat model ends at once, and the default max_tokens of 16).
"""
from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP = re.compile(r"<!-- readme-test: skip \((?P<why>[^)]+)\) -->\s*$")
FENCE = re.compile(r"^```python\n(?P<code>.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, code, skip reason or None) for each ```python block."""
    blocks = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        blocks.append((line, m.group("code"), skip.group("why") if skip else None))
    return blocks


async def run_block(code: str, namespace: dict, where: str) -> str:
    """Runs one block like a notebook cell (top-level await allowed); returns what it printed."""
    compiled = compile(code, where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = eval(compiled, namespace)
        if asyncio.iscoroutine(result):
            await result
    return out.getvalue()


def test_the_readme_has_python_blocks_and_few_are_skipped():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 5
    assert sum(skip is not None for _, _, skip in blocks) <= 2, "most README snippets must run as written"


@pytest.mark.slow
def test_every_readme_python_block_runs_as_written_on_the_embedded_model(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    blocks = python_blocks(README.read_text())
    namespace: dict = {"__name__": "__readme__"}

    async def main() -> dict[int, str]:
        printed = {}
        for line, code, skip in blocks:
            if skip is None:
                printed[line] = await run_block(code, namespace, f"README.md:{line}")
        return printed

    try:
        printed = asyncio.run(main())
    finally:
        llm = namespace.get("llm")
        if llm is not None:
            llm.close()
    for line, code, skip in blocks:
        if skip is None and "print(" in code:
            assert printed[line].strip(), f"the README block at line {line} prints nothing:\n{code}"
        if skip is None and "llm.abort(" in code:
            assert "abort" in printed[line], f"the README block at line {line} does not show the abort:\n{printed[line]}"
