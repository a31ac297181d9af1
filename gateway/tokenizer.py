"""Prompts to token ids and back, exactly as transformers does it, for the API and the offline engine
(the tokenizer itself comes from common/tokenizer.py)."""
from __future__ import annotations

from functools import cached_property

from transformers import PreTrainedTokenizerBase


class PromptEncoder:
    """Text or chat messages to token ids; the same ids in every path for the same input.

    `chat_template` (Jinja text) replaces the tokenizer's; `tool_call_parser` (--tool-call-parser)
    names the format of the calls the template's model makes under tool_choice "auto".
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None,
                 tool_call_parser: str = "auto") -> None:
        # here, not at module level: the offline engine encodes prompts without the API's modules
        from gateway.tool_parsers import tool_call_format

        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tool_call_format = tool_call_format(tool_call_parser, self.template_text)

    @property
    def template_text(self) -> str:
        """The chat template used with tools (a tokenizer may hold several, by name)."""
        template = self.chat_template or self.tokenizer.chat_template or ""
        if isinstance(template, dict):
            template = template.get("tool_use") or template.get("default") or ""
        return template

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                 chat_template=self.chat_template)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def is_special_token(self, text: str) -> bool:
        """Whether `text` is one token that decoding with skip_special_tokens leaves out."""
        return text in self._special_tokens

    @cached_property
    def _special_tokens(self) -> frozenset[str]:
        special_ids = set(self.tokenizer.all_special_ids)
        return frozenset(token for token, token_id in self.tokenizer.get_vocab().items() if token_id in special_ids)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
