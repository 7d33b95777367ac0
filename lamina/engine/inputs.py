"""Prompts the engine takes besides text and token-id lists.

Data in: a prompt already made into token ids, with the text it came from. Data out:
the same, as the engine's `add_request` / `validate` read it (ids checked against the
vocabulary; the text goes back in `RequestOutput.prompt`).

Why: a chat's prompt is written by the model's chat template, which puts in the
special tokens it wants (a `{{ bos_token }}`); tokenizing that text as a plain prompt
(special tokens added) would give Llama-style models two BOS tokens. HF's
`apply_chat_template(tokenize=True)` and vLLM tokenize a chat without adding any; so
does `chat_tokens` (`lamina.entrypoints.llm`), which makes one of these.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokensPrompt:
    prompt_token_ids: tuple[int, ...]
    prompt: str | None = None  # the text they were made from, if any

    def __post_init__(self):
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))


def check_unicode(text: str, what: str) -> None:
    """ValueError naming `what` where `text` cannot be UTF-8: a lone surrogate, which a
    JSON `\\ud800` escape alone decodes to (the tokenizer's own error names only its
    argument's types)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate "
                         f"U+{ord(text[e.start]):04X} at character {e.start}") from None
