"""The OpenAI-compatible HTTP server, run on the notebook kernel's own event loop (llm.serve) or from a terminal
(pagednb serve)."""
