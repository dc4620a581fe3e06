"""Notebook views on the public engine API (`LLM.stream`, `abort`, `stats`, `block_map`): a streaming
reply with Cancel, a chat, and the live KV pool. Needs ipywidgets (`pip install pagednb[notebook]`)."""
from pagednb.notebook.chat_view import ChatView, chat
from pagednb.notebook.pool_view import PoolView, pool_view
from pagednb.notebook.stream_view import StreamView, stream

__all__ = ["stream", "StreamView", "chat", "ChatView", "pool_view", "PoolView"]
