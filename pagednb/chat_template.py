"""Chat messages to prompt token ids through the tokenizer's chat template, for every caller alike
(`LLM.chat`, the notebook's chat, `python -m pagednb`), so they build the same prompt and refuse a
model without a template with the same message."""
from __future__ import annotations


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def check_chat_template(tokenizer) -> None:
    """Raises the one clear ValueError for a tokenizer without a chat template."""
    if not has_chat_template(tokenizer):
        raise ValueError("this model's tokenizer has no chat template; give a plain prompt (text or token ids) "
                         "instead, e.g. to generate() or stream()")


def apply_chat_template(tokenizer, conversation: list[dict], add_generation_prompt: bool = True,
                        kwargs: dict | None = None) -> list[int]:
    """The conversation's prompt token ids, ending with the assistant's generation prompt by default."""
    check_chat_template(tokenizer)
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **(kwargs or {}))
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
