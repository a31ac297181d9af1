"""Prompts to token ids and back, exactly as transformers does it, for the API and the offline engine
(the tokenizer itself comes from common/tokenizer.py)."""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from functools import cached_property
from typing import Any

from transformers import PreTrainedTokenizerBase

from common.multimodal import PLACEHOLDER_BASE

PROMPT_TAIL_TOKENS = 16  # the prompt's last tokens a reasoning parser reads (a pre-filled `<think></think>`)


class PromptEncoder:
    """Text or chat messages to token ids; the same ids in every path for the same input.

    `chat_template` (Jinja text) replaces the tokenizer's; `tool_call_parser` (--tool-call-parser)
    names the format of the calls the template's model makes under tool_choice "auto";
    `chat_template_kwargs` are the template's variables a request's own override
    (--default-chat-template-kwargs); `reasoning_parser` (--reasoning-parser) names the format of
    the model's thinking (gpt-oss's harmony calls, `openai`, bring its `openai_gptoss`).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None,
                 tool_call_parser: str = "auto", chat_template_kwargs: Mapping[str, Any] | None = None,
                 reasoning_parser: str | None = None) -> None:
        # here, not at module level: the offline engine encodes prompts without the API's modules
        from gateway.reasoning import reasoning_parser as find_reasoning_parser
        from gateway.tool_parsers import tool_call_format

        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tool_call_format = tool_call_format(tool_call_parser, self.template_text)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        # harmony's calls come after its analysis messages: its tool parser reads the answer the
        # reasoning parser leaves, so the one comes with the other
        if reasoning_parser is None and self.tool_call_format == "openai":
            reasoning_parser = "openai_gptoss"
        self.reasoning_parser = find_reasoning_parser(reasoning_parser)
        self.images = None  # a model that takes images: its gateway.multimodal.ImagePrompts

    @property
    def template_text(self) -> str:
        """The chat template used with tools (a tokenizer may hold several, by name)."""
        template = self.chat_template or self.tokenizer.chat_template or ""
        if isinstance(template, dict):
            template = template.get("tool_use") or template.get("default") or ""
        return template

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """`template_kwargs`: the request's chat_template_kwargs, over the server's defaults; a key
        that names one of apply_chat_template's own parameters is left out."""
        variables = self.template_variables(template_kwargs)
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                 chat_template=self.chat_template, **variables)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def template_variables(self, template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return {k: v for k, v in {**self.chat_template_kwargs, **(template_kwargs or {})}.items() if k not in _RESERVED}

    def is_special_token(self, text: str) -> bool:
        """Whether `text` is one token that decoding with skip_special_tokens leaves out."""
        return text in self._special_tokens

    @cached_property
    def _special_tokens(self) -> frozenset[str]:
        special_ids = set(self.tokenizer.all_special_ids)
        return frozenset(token for token, token_id in self.tokenizer.get_vocab().items() if token_id in special_ids)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def prompt_tail(self, token_ids: list[int]) -> str:
        """The text of the prompt's last tokens, special ones included (what a reasoning parser reads)."""
        tail = [t for t in token_ids[-PROMPT_TAIL_TOKENS:] if t < PLACEHOLDER_BASE]  # not an image's
        return self.tokenizer.decode(tail, skip_special_tokens=False)

    def skipped_ids_keeping(self, texts: tuple[str, ...]) -> frozenset[int] | None:
        """The ids that skip_special_tokens leaves out, but the tokens whose text is one of `texts`;
        None when none of `texts` is such a token (plain decoding keeps them all)."""
        kept = {self._special_ids[t] for t in texts if t in self._special_ids}
        return frozenset(self._special_ids.values()) - kept if kept else None

    @cached_property
    def _special_ids(self) -> dict[str, int]:
        """Each token decoding with skip_special_tokens leaves out: the named special tokens and
        the added tokens marked special."""
        special = set(self.tokenizer.all_special_ids)
        special |= {i for i, token in getattr(self.tokenizer, "added_tokens_decoder", {}).items() if token.special}
        return {self.tokenizer.convert_ids_to_tokens(i): i for i in special}


# apply_chat_template's own parameters: never template variables from a request
_RESERVED = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"kwargs"}
