"""Notebook views on the public engine API: a streaming reply, a chat and the live KV pool.

`stream` (with Cancel and a token-probability view), `chat` and `pool_view` use `LLM.stream`, `abort`,
`stats` and `block_map`; the engine debugger's tools use `pause`, `debug_step` and
`prefix_cache_snapshot`: a step-through debugger (`step_view`), the prefix-cache tree (`prefix_tree`)
and a memory planner (`plan`, `planner_view`). Needs ipywidgets and anywidget (`pip install
pagednb[notebook]`)."""
from pagednb.notebook.chat_view import ChatView, chat
from pagednb.notebook.planner import PlannerView, planner_view
from pagednb.notebook.pool_view import PoolView, pool_view
from pagednb.notebook.prefix_tree import PrefixTreeView, prefix_tree
from pagednb.notebook.step_view import StepView, step_view
from pagednb.notebook.stream_view import StreamView, stream
from pagednb.planner import MemoryPlan, plan

__all__ = ["stream", "StreamView", "chat", "ChatView", "pool_view", "PoolView", "step_view", "StepView",
           "prefix_tree", "PrefixTreeView", "plan", "MemoryPlan", "planner_view", "PlannerView"]
