"""`planner_view(llm)`: sliders over `pagednb.planner.plan` — prompt and output lengths, users, a shared
system prompt, and the what-ifs (gpu_memory_utilization on a GPU or kv_cache_memory on a CPU, the KV
dtype, max_model_len) — with the answer redrawn as they move. An anywidget (static/planner.js): the
browser sends the settings, Python computes the plan, so the numbers are the plain function's."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import anywidget
import traitlets

from pagednb.notebook.display import Displayable
from pagednb.notebook.throttle import BUDGET
from pagednb.planner import MemoryPlan, memory_budget, plan

STATIC = Path(__file__).parent / "static"
MiB = 2**20


class PlannerWidget(anywidget.AnyWidget):
    _esm = STATIC / "planner.js"
    _css = STATIC / "planner.css"
    settings = traitlets.Dict().tag(sync=True)  # the sliders' values (set by the browser)
    limits = traitlets.Dict().tag(sync=True)  # the sliders' ranges
    result = traitlets.Dict().tag(sync=True)  # the plan, or {"error": ...}


class PlannerView(Displayable):
    def __init__(self, llm, prompt_tokens: int, output_tokens: int, users: int) -> None:
        self._llm = llm
        engine = llm.engine
        self.on_gpu = engine.pool_plan.gpu_memory is not None
        memory = ({"gpu_memory_utilization": engine.config.gpu_memory_utilization} if self.on_gpu else
                  {"kv_cache_memory_mib": round(memory_budget(engine, None, None) / MiB, 2)})
        self._start_memory = memory  # the engine's own setting: no what-if while the slider stays there
        self.widget = PlannerWidget(
            limits={"max_position_embeddings": engine.spec.max_position_embeddings, "on_gpu": self.on_gpu,
                    "max_users": max(4 * engine.config.max_num_seqs, 64)},
            settings={"prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "users": users,
                      "shared_prefix_tokens": 0, "dtype": str(engine.runner.kv_cache_dtype).removeprefix("torch."),
                      "max_model_len": engine.max_model_len, **memory})
        self.plan: MemoryPlan | None = None
        self.widget.observe(self._recompute, names="settings")
        self._recompute()

    def _recompute(self, _change=None) -> None:
        s = dict(self.widget.settings)
        what_if = {}
        if self.on_gpu and s["gpu_memory_utilization"] != self._start_memory["gpu_memory_utilization"]:
            what_if["gpu_memory_utilization"] = s["gpu_memory_utilization"]
        elif not self.on_gpu and s["kv_cache_memory_mib"] != self._start_memory["kv_cache_memory_mib"]:
            what_if["kv_cache_memory"] = round(s["kv_cache_memory_mib"] * MiB)
        try:
            self.plan = plan(self._llm, s["prompt_tokens"], s["output_tokens"], s["users"],
                             shared_prefix_tokens=min(s["shared_prefix_tokens"], s["prompt_tokens"]),
                             dtype=s["dtype"], max_model_len=s["max_model_len"], **what_if)
            result = {**dataclasses.asdict(self.plan), "users_fit": self.plan.users_fit, "fits": self.plan.fits,
                      "text": str(self.plan)}
        except (TypeError, ValueError) as error:
            self.plan, result = None, {"error": str(error)}
        BUDGET.take(1)
        self.widget.result = result


def planner_view(llm, prompt_tokens: int = 512, output_tokens: int = 256, users: int = 8, *,
                 display: bool = True) -> PlannerView:
    """Shows the memory planner's sliders for `llm`, starting at the given workload."""
    view = PlannerView(llm, prompt_tokens, output_tokens, users)
    if display:
        view.show()
    return view
