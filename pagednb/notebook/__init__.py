"""Notebook views on the public engine API (`LLM.stream`, `abort`, `stats`, `block_map`): a streaming
reply with Cancel and a token-probability view, a chat, and the live KV pool; and the engine debugger's tools (`pause`, `debug_step`,
`prefix_cache_snapshot`): a step-through debugger, the prefix-cache tree and a memory planner. Needs
ipywidgets and anywidget (`pip install pagednb[notebook]`)."""
from pagednb.notebook.chat_view import ChatView, chat
from pagednb.notebook.planner import PlannerView, planner_view
from pagednb.notebook.pool_view import PoolView, pool_view
from pagednb.notebook.prefix_tree import PrefixTreeView, prefix_tree
from pagednb.notebook.step_view import StepView, step_view
from pagednb.notebook.stream_view import StreamView, stream
from pagednb.planner import MemoryPlan, plan

__all__ = ["stream", "StreamView", "chat", "ChatView", "pool_view", "PoolView", "step_view", "StepView",
           "prefix_tree", "PrefixTreeView", "plan", "MemoryPlan", "planner_view", "PlannerView"]
