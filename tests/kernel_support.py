"""Running code in a real Jupyter kernel (jupyter_client), as the notebook-behaviour tests do."""
from __future__ import annotations


def run_cell(client, code: str, timeout: int = 120) -> str:
    """Executes one cell; returns its stream output, and fails with the cell's traceback if it raised."""
    outputs = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            outputs.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            outputs.append("ERROR: " + "\n".join(msg["content"]["traceback"]))
    reply = client.execute_interactive(code, timeout=timeout, output_hook=hook)
    text = "".join(outputs)
    assert reply["content"]["status"] == "ok", text
    return text
