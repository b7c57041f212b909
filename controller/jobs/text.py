"""The model's text side, for the front door: its tokenizer, prompts through its chat template,
incremental detokenizing, and stop strings that never leak into what a client is sent."""
from __future__ import annotations

import logging
from pathlib import Path

from transformers import AutoTokenizer

from logicpipe.controller.api.tools import renders_tools, system_text

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool")  # tool: a tool's answer in a tool loop


def load_tokenizer(model_dir: Path):
    """The model's tokenizer, or None for a directory without one (then prompts come as token ids)."""
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        log.warning("%s has no tokenizer: only prompt_token_ids can be submitted", model_dir)
        return None
    return AutoTokenizer.from_pretrained(str(model_dir))


def encode_prompt(tokenizer, prompt: str, raw: bool = False) -> list[int]:
    """Token ids of a user prompt: wrapped in the model's chat template unless `raw`."""
    if raw or not tokenizer.chat_template:
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_chat(tokenizer, messages: list[tuple[str, str]], tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation [(role, content), ...] through the model's chat template, ready
    for the assistant's answer (roles checked by the caller); `tools` (OpenAI's) through the
    template when it renders them, else in a system message (controller.tools)."""
    native = renders_tools(tokenizer)
    # a tool's answer: the template's own tool turn where it lays tools out, else a user turn the
    # way the tools' system message (qwen's wording) expects it
    turns = [{"role": r, "content": c} if r != "tool" or native else
             {"role": "user", "content": f"<tool_response>\n{c}\n</tool_response>"} for r, c in messages]
    extra = {}
    if tools and native:
        extra = {"tools": tools}
    elif tools:
        if turns and turns[0]["role"] == "system":
            turns[0] = {"role": "system", "content": turns[0]["content"] + "\n\n" + system_text(tools)}
        else:
            turns.insert(0, {"role": "system", "content": system_text(tools)})
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, **extra)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class TextStream:
    """Incremental detokenization, O(1) per token: decode a short window from the last emitted
    boundary and emit what it adds (a partial UTF-8 character is held back until it completes)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start: a few tokens before `read`, so merges across it decode right
        self.read = 0    # tokens whose text has been emitted

    def push(self, token_ids: list[int], final: bool = False) -> str:
        self.ids.extend(token_ids)
        if self.tokenizer is None:
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class StopScan:
    """Text released to a client, cut before the first of the stop strings: the tail that could be
    the start of one is held back until the next text (or the end) shows it is not. Only that
    tail is kept and searched, so a push costs the new text plus the longest stop (capped at the
    front door), never the whole answer again."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.held = max((len(s) for s in stops), default=1) - 1  # characters a stop may have begun in
        self.pending = ""  # text seen and not released yet (at most `held` characters between pushes)
        self.stopped = False
        self.matched = ""  # the stop string that ended the text, once one did

    def push(self, text: str, final: bool = False) -> str:
        """The text that may be released now (all that is left when `final` or a stop was found)."""
        if self.stopped:
            return ""
        pending = self.pending + text  # a stop that began in released text would have been found then
        cut, self.matched = min(((i, s) for s in self.stops if (i := pending.find(s)) >= 0), default=(-1, ""))
        if cut >= 0:
            self.pending, self.stopped = "", True
            return pending[:cut]
        keep = 0 if final or not self.stops else min(len(pending), self.held)
        self.pending = pending[len(pending) - keep:]
        return pending[:len(pending) - keep]
