"""Chat conversations to prompt text, through the checkpoint's own chat template or DeepSeek's format.

A conversation is a list of messages `{"role": "system" | "user" | "assistant", "content": str}` (content may also
be a list of `{"type": "text", "text": ...}` parts, as OpenAI's API writes it). The template is the one the
checkpoint's tokenizer_config.json (or chat_template.jinja) carries; without one it is DeepSeek's chat format:
the tokenizer's bos token, the system prompts, then `<｜User｜>` before each user turn and `<｜Assistant｜>` before
each assistant turn, which ends with the eos token; the generation prompt is `<｜Assistant｜>` followed by
`</think>` (answer directly) or, with `chat_template_kwargs={"thinking": True}`, `<think>` (reason first).
The text is tokenized without adding special tokens, since the template places them.
"""

from __future__ import annotations

from typing import Any

from deepinfer.engine.request import RequestError

DEEPSEEK_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages if message['role'] == 'system' %}{{ message['content'] }}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜></think>' + message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' + ('<think>' if thinking else '</think>') }}{%- endif %}"
)
ROLES = ("system", "user", "assistant")


def is_conversation(value: Any) -> bool:
    """Whether `value` is one conversation (a list of message dicts) rather than a list of conversations."""
    return isinstance(value, (list, tuple)) and (not value or isinstance(value[0], dict))


def check_conversation(messages: Any) -> list[dict[str, str]]:
    """The messages with text content; RequestError naming the first malformed message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError(f"a conversation is a non-empty list of messages, got {messages!r:.80}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"message {i} is a {type(message).__name__}, not a dict with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise RequestError(f"message {i}: role {role!r} is not one of {', '.join(ROLES)}")
        if isinstance(content, (list, tuple)):  # OpenAI-style content parts: only text
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"message {i}: content parts must all be {{'type': 'text', 'text': str}}")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"message {i}: content must be a string, got {type(content).__name__}")
        checked.append({"role": role, "content": content})
    return checked


def render(hf_tokenizer, messages: list[dict[str, str]], chat_template: str | None, add_generation_prompt: bool,
           chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of one checked conversation (`check_conversation`)."""
    kwargs = {"thinking": False, **(chat_template_kwargs or {})}
    try:
        return hf_tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                                add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja2 raises its own error types
        raise RequestError(f"the chat template cannot render this conversation: {type(e).__name__}: {e}") from None
