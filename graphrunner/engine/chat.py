"""`LLM.chat`: conversations rendered into prompts through the tokenizer's chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ChatMessage = dict[str, Any]  # {"role": "user", "content": "Hello"} (content: a text or OpenAI's text parts)
ChatMessages = list[ChatMessage]  # one conversation


def render_chat(
    tokenizer: Any, messages: ChatMessages | Sequence[ChatMessages], *, chat_template: str | None = None,
    add_generation_prompt: bool = True, continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One prompt dict per conversation: its rendered text and its token ids (the template's own
    special tokens kept, none added: vLLM's encoding of chat prompts).

    `messages` is one conversation (a list of message dicts) or a list of them. ValueError names
    the tokenizer's folder when it has no chat template, and the message when one is malformed.
    """
    if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError("chat needs a tokenizer with a chat template (transformers'), and this model has "
                         + ("none" if tokenizer is None else "only a `tokenizers` one: pip install transformers"))
    conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if not template:
        folder = getattr(tokenizer, "name_or_path", "") or "the tokenizer's folder"
        raise ValueError(f"{Path(folder) / 'tokenizer_config.json'} has no chat_template (nor a "
                         "chat_template.jinja beside it): pass chat_template= to LLM.chat")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt=True and continue_final_message=True contradict each other; "
                         "pass add_generation_prompt=False to continue the last message")
    prompts = []
    for i, conversation in enumerate(conversations):
        checked = [_message(i, j, m) for j, m in enumerate(conversation)]
        try:
            text = tokenizer.apply_chat_template(
                checked, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        except Exception as e:  # jinja2's errors: the template or the messages do not fit
            raise ValueError(f"conversation {i}: the chat template failed: {type(e).__name__}: {e}") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        prompts.append({"prompt": text, "prompt_token_ids": list(ids)})
    return prompts


def _message(i: int, j: int, message: Any) -> ChatMessage:
    """Message j of conversation i with its content as one text (OpenAI's text parts joined)."""
    if not isinstance(message, Mapping) or "role" not in message:
        raise ValueError(f"conversation {i} message {j}: a message is a dict with 'role' and 'content', "
                         f"got {message!r:.80}")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"conversation {i} message {j}: content part of type {kind!r} is not supported; "
                                 "only text parts are")
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    return {**message, "content": "" if content is None else content}
