"""Conversations rendered with a chat template, and which of their tokens the assistant wrote.

A conversation is a list of {"role": "system" | "user" | "assistant", "content": str}. It is rendered with the
tokenizer's own Jinja chat template (a Hugging Face tokenizer folder's `chat_template`), rendered as
`transformers`' `apply_chat_template` renders it, or with `CHATML_TEMPLATE` when the tokenizer carries none.
The assistant's part of each turn is found by rendering the prefixes of the conversation: the text between
"everything before, with the generation prompt" and "everything up to this turn" is what the model must learn
to write, its end-of-turn tokens included (docs/architecture.md, SFT). The server's /v1/chat/completions
renders its prompts with the same class (`serving_chat_format`), so it serves exactly what SFT trained on.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from megatron_train.tokenizer.base import MegatronTokenizer

ROLES = ("system", "user", "assistant")
# The default template (ChatML), used when the tokenizer's files carry no chat template.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PromptFormat = Literal["chat-template", "chatml"]


def _raise(message: str) -> None:
    raise ValueError(f"the chat template refuses the conversation: {message}")


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    """The template compiled in a sandbox, with the settings and helpers `transformers` gives it."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.globals["raise_exception"] = _raise
    return environment.from_string(template)


def _token_text(tokenizer: MegatronTokenizer, name: str) -> str:
    """The text of the tokenizer's `name` token (bos, eos), "" when it has none."""
    try:
        token_id = getattr(tokenizer, name)
    except NotImplementedError:
        return ""
    return "" if token_id is None or token_id < 0 else tokenizer.inv_vocab.get(token_id, "")


class ChatFormat:
    """Renders conversations with one template and tokenizes them with the assistant's tokens marked."""

    def __init__(self, tokenizer: MegatronTokenizer, prompt_format: PromptFormat = "chat-template") -> None:
        self.tokenizer = tokenizer
        own = tokenizer.chat_template if prompt_format == "chat-template" else None
        self.template = own or CHATML_TEMPLATE
        self.special_tokens = {
            "bos_token": _token_text(tokenizer, "bos"),
            "eos_token": _token_text(tokenizer, "eos"),
        }

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        return _compiled(self.template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )

    def prompt(self, messages: list[dict[str, Any]]) -> str:
        """The text a model answers `messages` from: the rendering up to the assistant's turn opening. A BOS
        the template writes first is left out when `tokenize` adds one itself (no BOS twice)."""
        text = self.render(messages, add_generation_prompt=True)
        bos = self.special_tokens["bos_token"]
        if bos and text.startswith(bos) and self.tokenizer.tokenize("")[:1] == [self.tokenizer.bos]:
            text = text[len(bos) :]
        return text

    def segments(self, messages: list[dict[str, Any]]) -> list[tuple[str, bool]]:
        """The rendered conversation cut into (text, written by the assistant) pieces, in order."""
        full = self.render(messages)
        pieces, position = [], 0
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:index], add_generation_prompt=True)
            upto = self.render(messages[: index + 1])
            start = len(prompt)
            if not (full.startswith(upto) and upto.startswith(prompt) and position <= start):
                raise ValueError(
                    f"the chat template does not render message {index} as an extension of the ones before it, "
                    "so its assistant tokens cannot be told apart; use --sft-tokenizer-prompt-format chatml"
                )
            pieces += [(full[position:start], False), (full[start : len(upto)], True)]
            position = len(upto)
        pieces.append((full[position:], False))
        return [(text, is_assistant) for text, is_assistant in pieces if text]

    def tokenize(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
        """(token ids, whether the assistant wrote each token) of one conversation."""
        tokens: list[int] = []
        assistant: list[bool] = []
        for text, is_assistant in self.segments(messages):
            ids = self.tokenizer.tokenize_without_special_tokens(text)
            tokens += ids
            assistant += [is_assistant] * len(ids)
        return tokens, assistant


def serving_chat_format(tokenizer: MegatronTokenizer, sft_prompt_format: PromptFormat | None) -> ChatFormat:
    """The chat format a server renders conversations with: the one the checkpoint's SFT run trained on
    (`--sft --sft-tokenizer-prompt-format`), else the tokenizer's own template, which a model trained without
    --sft needs (it was never taught ChatML)."""
    if sft_prompt_format is None and tokenizer.chat_template is None:
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}) has no chat template: serve a checkpoint whose tokenizer "
            "is a Hugging Face folder with a chat_template (--tokenizer-type HuggingFaceTokenizer "
            "--tokenizer-model DIR) or one trained with --sft, or use /v1/completions"
        )
    return ChatFormat(tokenizer, sft_prompt_format or "chat-template")
