"""The engine inside a real Jupyter kernel (ipykernel 7.4, and 6.x where .ci/run provides it): a cell
starts a stream in the background and returns, later cells run while it advances, a Cancel from a
callback on another thread stops it within two steps, and "Run All" of a notebook that mixes
synchronous and asynchronous calls finishes."""
import json
import os
import sys
import textwrap

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

from kernel_support import run_cell

IPYKERNEL6_PYTHONPATH = os.environ.get("PAGEDNB_IPYKERNEL6_PATH")  # a folder holding ipykernel 6.x

# Steps of a known length: each model step sleeps 10 ms, so a 480-token stream lasts several seconds.
SETUP = textwrap.dedent("""
    import asyncio, threading, time
    from pagednb import LLM, SamplingParams
    llm = LLM(num_kv_blocks=256)
    real_launch = llm.engine.runner.launch
    def slow_launch(*args, **kwargs):
        time.sleep(0.01)
        return real_launch(*args, **kwargs)
    llm.engine.runner.launch = slow_launch
    progress = []
""")




@pytest.fixture
def kernel_and_manager():
    manager, client = start_new_kernel(kernel_name="python3", env={**os.environ, "HF_HUB_OFFLINE": "1"})
    yield client, manager
    client.stop_channels()
    manager.shutdown_kernel(now=True)


@pytest.fixture
def kernel(kernel_and_manager):
    return kernel_and_manager[0]


def test_background_stream_advances_across_cells_and_a_callback_cancels_it(kernel):
    run_cell(kernel, SETUP + "import ipykernel; print(ipykernel.__version__)")
    run_cell(kernel, textwrap.dedent("""
        async def consume():
            params = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
            async for out in llm.stream("Tell me a story about a cat named Tom.", params, request_id="story"):
                progress.append((llm.driver.num_steps, len(out.outputs[0].token_ids), out.outputs[0].finish_reason))
        task = asyncio.ensure_future(consume())
    """))  # returns at once: the stream runs in the background
    seen = run_cell(kernel, "n1 = len(progress); await asyncio.sleep(0.3); print(n1, len(progress))")
    n1, n2 = map(int, seen.split())
    assert n2 > n1, "the stream advanced while this cell ran"
    result = run_cell(kernel, textwrap.dedent("""
        abort_step = llm.driver.num_steps
        threading.Thread(target=llm.abort, args=("story",)).start()   # as a widget callback would
        await asyncio.wait_for(task, 5)
        print(abort_step, progress[-1][0], progress[-1][1], progress[-1][2], llm.stats()["used_blocks"])
    """))
    abort_step, end_step, tokens, reason, used = result.split()
    assert reason == "abort" and int(tokens) < 480
    assert int(end_step) - int(abort_step) <= 2
    assert int(used) == 0


def test_interrupting_a_sync_generate_aborts_it_and_the_engine_stays_usable(kernel_and_manager):
    import threading
    kernel, manager = kernel_and_manager
    run_cell(kernel, SETUP + "expected = llm.generate('The cat', SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)")
    threading.Timer(1.0, manager.interrupt_kernel).start()  # the notebook's stop button
    reply = kernel.execute_interactive(
        "llm.generate(['Once upon a time'] * 4, SamplingParams(temperature=0, max_tokens=450, ignore_eos=True))",
        timeout=60)
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    out = run_cell(kernel, textwrap.dedent("""
        stats = llm.stats()
        again = llm.generate('The cat', SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        print(stats["used_blocks"], stats["running"], stats["waiting"],
              again[0].outputs[0].token_ids == expected[0].outputs[0].token_ids)
    """))
    assert out.split() == ["0", "0", "0", "True"]


RUN_ALL_CELLS = [
    SETUP,
    "sync = llm.generate(['Tell me a story about a dog named Max.'], SamplingParams(temperature=0, max_tokens=40))\n"
    "print(sync[0].outputs[0].finish_reason)",
    "out = await llm.agenerate('Tell me a story about a cat named Tom.', SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))\n"
    "assert out.outputs[0].finish_reason == 'length'",
    "async def consume():\n"
    "    async for o in llm.stream('Once upon a time', SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)):\n"
    "        progress.append(o)\n"
    "task = asyncio.ensure_future(consume())",
    "chat = llm.chat([{'role': 'user', 'content': 'What is 2 plus 3?'}], SamplingParams(temperature=0, max_tokens=20))\n"
    "print(chat[0].outputs[0].text)",
    "await task\nassert progress[-1].finished and len(progress[-1].outputs[0].token_ids) == 60",
    "print('used', llm.stats()['used_blocks'])\nllm.close()",
]


def run_all(kernel_name: str, tmp_path, env=None) -> list[str]:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(code) for code in RUN_ALL_CELLS]
    client = NotebookClient(nb, timeout=180, kernel_name=kernel_name, resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env) if env else client.execute()
    return ["".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout") for cell in nb.cells]


def test_run_all_mixing_sync_and_async_calls_finishes_on_ipykernel_7(tmp_path):
    import ipykernel
    assert ipykernel.version_info[0] >= 7
    texts = run_all("python3", tmp_path)
    assert texts[1].strip() in ("stop", "length") and texts[4].strip() == "2 plus 3 is 5." and texts[6].strip() == "used 0"


@pytest.mark.skipif(IPYKERNEL6_PYTHONPATH is None,
                    reason="PAGEDNB_IPYKERNEL6_PATH names no folder holding ipykernel 6.x (.ci/run sets it)")
def test_run_all_mixing_sync_and_async_calls_finishes_on_ipykernel_6(tmp_path, monkeypatch):
    spec_dir = tmp_path / "kernels" / "ipykernel6"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "ipykernel 6", "language": "python",
        "env": {"PYTHONPATH": IPYKERNEL6_PYTHONPATH, "HF_HUB_OFFLINE": "1"},
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    nb_cells_version = RUN_ALL_CELLS[0]
    RUN_ALL_CELLS[0] = nb_cells_version + "\nimport ipykernel\nassert ipykernel.version_info[0] == 6, ipykernel.__version__"
    try:
        texts = run_all("ipykernel6", tmp_path)
    finally:
        RUN_ALL_CELLS[0] = nb_cells_version
    assert texts[1].strip() in ("stop", "length") and texts[4].strip() == "2 plus 3 is 5." and texts[6].strip() == "used 0"
