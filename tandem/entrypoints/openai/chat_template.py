"""Chat templates through transformers' `apply_chat_template`: the template a model folder ships (chat_template.jinja,
tokenizer_config.json's string or list of named templates) or `--chat-template FILE|STRING`, rendered in
transformers' sandboxed Jinja environment with the tokenizer's special tokens, tools and add_generation_prompt.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any


class ChatTemplateError(ValueError):
    """A template that cannot render these messages (a bad template, or one that refuses the conversation)."""


def resolve_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's contents, or the value itself when it is a Jinja template (as vLLM reads it)."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template={value!r} is not allowed: a file that exists, or a Jinja template string")


class ChatTemplate:
    def __init__(self, model_folder: str, override: str | None = None):
        self.model_folder, self.override = model_folder, override

    @cached_property
    def _tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_folder, local_files_only=True)

    @property
    def source(self) -> str | dict[str, str] | None:
        """The template text (named templates: name -> text), None without one."""
        return self.override if self.override is not None else self._tokenizer.chat_template

    @property
    def available(self) -> bool:
        return self.source is not None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """The prompt text of `messages`; ChatTemplateError when the template fails or refuses them."""
        from jinja2 import TemplateError

        if not self.available:
            raise ChatTemplateError(f"model {Path(self.model_folder).name!r} has no chat template (chat_template.jinja "
                                    "or tokenizer_config.json chat_template; serve with --chat-template FILE|STRING); "
                                    "use /v1/completions")
        try:
            return self._tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.override,
                                                       add_generation_prompt=add_generation_prompt, tokenize=False,
                                                       **template_kwargs)
        except (TemplateError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            # SecurityError (a sandbox escape attempt) is a TemplateError: the template does not run
            raise ChatTemplateError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from e
