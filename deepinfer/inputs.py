"""Prompts as `LLM.generate` takes them, with vLLM's names: a string, `TextPrompt` or `TokensPrompt`.

`parse_prompt` turns one into (text, token ids) and raises `RequestError` naming what is wrong with it (a
`prompt_token_ids` that is not a list, text that is not valid Unicode, a key nobody reads), so a bad prompt fails
its own request and no other.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

from deepinfer.engine.request import RequestError


class TextPrompt(TypedDict):
    """A prompt given as text: `{"prompt": "def fib(n):"}`."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt given as token ids: `{"prompt_token_ids": [0, 3, 14]}`; `prompt`, if given, is only reported."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt
_KEYS = ("prompt", "prompt_token_ids")


def check_text(text: str, what: str = "the prompt") -> str:
    """`text` if it is a str that encodes as UTF-8; RequestError naming the first lone surrogate otherwise."""
    if not isinstance(text, str):
        raise RequestError(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{what} is not valid Unicode text: a lone surrogate U+{ord(text[e.start]):04X} at "
                           f"character {e.start}") from None
    return text


def parse_prompt(tokenizer, prompt: Any) -> tuple[str | None, list[int]]:
    """(text, token ids) of a string, `{"prompt": str}` or `{"prompt_token_ids": [...]}` (ids are checked against
    the vocabulary later, by `check_prompt`)."""
    if isinstance(prompt, RequestError):  # a prompt that could not be made (LLM.chat's rendering): its own message
        raise prompt
    if isinstance(prompt, str):
        return prompt, _encode(tokenizer, check_text(prompt))
    if not isinstance(prompt, dict):
        raise RequestError(f"a prompt is a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}; "
                           f"got {type(prompt).__name__}")
    unknown = sorted(str(k) for k in prompt if k not in _KEYS)
    if unknown:
        raise RequestError(f"prompt keys {unknown} are not supported (a prompt has 'prompt' or 'prompt_token_ids')")
    text = prompt.get("prompt")
    if text is not None:
        check_text(text)
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise RequestError(f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
        return text, list(ids)
    if text is None:
        raise RequestError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (a list of ids)")
    return text, _encode(tokenizer, text)


def _encode(tokenizer, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text))
    except Exception as e:  # noqa: BLE001 - the tokenizer raises its own error types
        raise RequestError(f"the tokenizer cannot encode the prompt: {type(e).__name__}: {e}") from None
