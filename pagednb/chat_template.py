"""Chat messages to prompt token ids through the tokenizer's chat template, for every caller alike
(`LLM.chat`, the notebook's chat, `python -m pagednb`), so they build the same prompt, refuse a model
without a template with the same message, and refuse malformed messages naming the one at fault
(before a template renders them into a prompt the user did not mean)."""
from __future__ import annotations


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def check_chat_template(tokenizer) -> None:
    """Raises the one clear ValueError for a tokenizer without a chat template."""
    if not has_chat_template(tokenizer):
        raise ValueError("this model's tokenizer has no chat template; give a plain prompt (text or token ids) "
                         "instead, e.g. to generate() or stream()")


def check_conversation(conversation: object, name: str = "messages") -> None:
    """A conversation is a list of dicts, each with a str 'role' and a 'content' that is a str or a list of
    parts (dicts with a str 'type', e.g. {"type": "text", "text": "..."}). TypeError naming the index."""
    if not isinstance(conversation, (list, tuple)):
        raise TypeError(f"{name} must be a list of messages (dicts with 'role' and 'content'), "
                        f"got {type(conversation).__name__}")
    for i, message in enumerate(conversation):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"{where} has no {key!r}; a message is {{'role': 'user', 'content': 'Hi'}}")
        if not isinstance(message["role"], str) or not message["role"]:
            raise TypeError(f"{where}['role'] must be a non-empty str (e.g. 'system', 'user', 'assistant'), "
                            f"got {message['role']!r}")
        _check_content(message["content"], f"{where}['content']")


def _check_content(content: object, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise TypeError(f"{where} must be a str or a list of parts, got {type(content).__name__}")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise TypeError(f"{where}[{j}] must be a dict with a str 'type' (e.g. {{'type': 'text', 'text': "
                            f"'...'}}), got {part!r:.60}")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise TypeError(f"{where}[{j}]['text'] must be a str, got {part.get('text')!r:.60}")


def apply_chat_template(tokenizer, conversation: list[dict], add_generation_prompt: bool = True,
                        kwargs: dict | None = None, name: str = "messages") -> list[int]:
    """The conversation's prompt token ids, ending with the assistant's generation prompt by default.
    `name` is how errors refer to the conversation (e.g. "messages[2]" in a batch)."""
    check_chat_template(tokenizer)
    check_conversation(conversation, name)
    if not isinstance(add_generation_prompt, bool):
        raise TypeError(f"add_generation_prompt must be True or False, got {add_generation_prompt!r}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"chat_template_kwargs must be a dict or None, got {type(kwargs).__name__}")
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **(kwargs or {}))
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
