"""Prompts for the views: a plain prompt as the engine takes it, or chat messages through the template."""
from __future__ import annotations


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The tokenizer's chat template over a conversation, ending with the assistant's generation prompt."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; pass a plain prompt instead")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def engine_prompt(llm, prompt):
    """What `llm.stream` takes: a list of chat messages becomes its templated token ids (as `llm.chat`
    would build them); a string, token ids or {"prompt_token_ids": ...} pass through unchanged."""
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        return {"prompt_token_ids": chat_prompt_ids(llm.get_tokenizer(), prompt)}
    return prompt
