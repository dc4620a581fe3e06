"""Shared helpers for the benchmark scripts: environment facts and writing the JSON result."""
from __future__ import annotations

import datetime
import json
import platform
import shlex
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def environment() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
    }


def save(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **result}, indent=1) + "\n")
    return path


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in headers]] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for j, row in enumerate(cells):
        print(" | ".join(c.rjust(w) for c, w in zip(row, widths)))
        if j == 0:
            print("-+-".join("-" * w for w in widths))
