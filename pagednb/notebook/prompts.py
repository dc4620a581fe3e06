"""Prompts for the views: a plain prompt as the engine takes it, or chat messages through the template."""
from __future__ import annotations

from pagednb.chat_template import apply_chat_template


def engine_prompt(llm, prompt):
    """What `llm.stream` takes: a list of chat messages becomes its templated token ids (as `llm.chat`
    would build them); a string, token ids or {"prompt_token_ids": ...} pass through unchanged."""
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        return {"prompt_token_ids": apply_chat_template(llm.get_tokenizer(), prompt)}
    return prompt
