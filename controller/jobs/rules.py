"""What a request may ask, whichever door it comes by: the caps, the prompt (`Prompt`), the
options (`RequestOptions`, `OutlineOptions`) and their checks. The front door (controller.jobs.door)
runs `checked` before any work; the adapters (gRPC, HTTP) build these types and may run a check
early to name their own field (`check_stops`). A refusal is an InvalidArgument naming the
parameter."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from logicpipe.controller.jobs.grammar_check import check_schema
from logicpipe.controller.jobs.outline import MAX_POINTS
from logicpipe.controller.jobs.text import CHAT_ROLES
from logicpipe.errors import InvalidArgument
from logicpipe.limits import check_request_id
from logicpipe.sampling import SamplingParams

MAX_PROMPT_CHARS = 2**20   # characters of one prompt or conversation (refused before any work beyond that)
MAX_PROMPT_TOKENS = 2**17  # token ids of one prompt
MAX_CHAT_MESSAGES = 1024   # turns of one conversation
MAX_STOPS = 4              # stop strings of one request (OpenAI's cap)
MAX_STOP_BYTES = 1024      # UTF-8 bytes of one stop string (what may be held back of a stream is this long)
MAX_CHOICES = 16           # completions of one prompt in one request (OpenAI's n)

ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system turn (o1 and later models)
ROLES = (*CHAT_ROLES, *ROLE_ALIASES)    # the roles a conversation's turns may have


async def checked(prompt: Prompt, options: RequestOptions) -> None:
    """Every rule a request breaks before any work, as a MeshError: its prompt's, its options', and
    a grammar (json_schema) compiled off the event loop and shown to admit some JSON value (one
    that admits none would have every stage step fail on it: a fault, not the client's error)."""
    prompt.check()
    options.check()
    if options.json_schema:
        try:
            await asyncio.to_thread(check_schema, options.json_schema)
        except ValueError as exc:
            raise InvalidArgument(f"json_schema: {exc}") from exc


def check_stops(stops) -> None:
    """InvalidArgument naming `stop` unless `stops` is up to MAX_STOPS non-empty strings of up to
    MAX_STOP_BYTES each."""
    if len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise InvalidArgument(f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them")
    for i, s in enumerate(stops):
        size = len(s.encode("utf-8", "surrogatepass"))
        if size > MAX_STOP_BYTES:
            raise InvalidArgument(f"stop[{i}] is {size} bytes (UTF-8), over the cap of {MAX_STOP_BYTES} bytes a "
                                  "stop string")


@dataclass(frozen=True)
class Prompt:
    """What to continue: exactly one of a text, a conversation or token ids."""

    text: str = ""
    raw: bool = False                                  # the text as is, no chat template
    messages: tuple[tuple[str, str], ...] = ()         # (role, content) turns, through the chat template
    token_ids: tuple[int, ...] = ()                    # already tokenized
    tools: str = ""                                    # with messages: OpenAI's tools (a JSON list), in the prompt

    def check(self) -> None:
        # a blank prompt beside messages is still two inputs: one would be dropped without a word
        given = [name for name, v in (("a prompt", self.text), ("messages", self.messages),
                                      ("prompt token ids", self.token_ids)) if v]
        if len(given) > 1:
            raise InvalidArgument(f"give one of a prompt, messages or prompt token ids, not {' and '.join(given)}")
        if not (self.text.strip() or self.messages or self.token_ids):
            raise InvalidArgument("the prompt is empty: give a prompt, messages or prompt token ids")
        if self.raw and not self.text:
            raise InvalidArgument("raw is for a prompt text (no chat template): not with messages (they go through "
                                  "the template) or prompt token ids (already tokenized)")
        chars = len(self.text) + sum(len(c) for _, c in self.messages)
        if chars > MAX_PROMPT_CHARS or len(self.token_ids) > MAX_PROMPT_TOKENS:
            raise InvalidArgument(f"the prompt is {chars} characters / {len(self.token_ids)} token ids, over the cap "
                                  f"of {MAX_PROMPT_CHARS} characters / {MAX_PROMPT_TOKENS} ids")
        if self.messages and len(self.messages) > MAX_CHAT_MESSAGES:
            raise InvalidArgument(f"a conversation has 1 to {MAX_CHAT_MESSAGES} messages, not {len(self.messages)}")
        for i, (role, _) in enumerate(self.messages):
            if role not in ROLES:
                raise InvalidArgument(f"messages[{i}]: role must be one of {', '.join(ROLES)} (developer is taken "
                                      f"as system), not {role[:20]!r}")


@dataclass(frozen=True)
class OutlineOptions:
    """An outline-DAG request (see controller/jobs/outline.py); `max_tokens` is then per point."""

    max_points: int = 0          # 0: the default (8)
    outline_text: str = ""       # use this outline instead of asking the model for one
    sequential: bool = False     # decode the points one after another (for comparison)


@dataclass(frozen=True)
class RequestOptions:
    max_tokens: int                                 # new tokens at most (per point for an outline); 0: none,
                                                    # the prompt only (its logprobs: prompt_logprobs)
    sampling: SamplingParams = SamplingParams()
    ignore_eos: bool = False                        # go on past the model's stop tokens (benchmarks)
    speculate: int | None = None                    # candidates per step at most (None: the controller's)
    prefill_chunk: int = 0                          # prompt tokens per step (0: the controller's choice)
    stop: tuple[str, ...] = ()                      # stop strings: the text ends before the first
    outline: OutlineOptions | None = None
    request_id: str = ""                            # the client's id for it ("" : the controller makes one)
    api: str = ""                                   # which door it came by ("grpc", "chat", "completions")
    top_logprobs: int | None = None                 # each token's logprob and this many most likely (None: none)
    prompt_logprobs: int | None = None              # ... each prompt token's too, from the second (None: none)
    json_schema: str = ""                           # structured output: "json_object" or a JSON schema ("": none)

    def check(self) -> None:
        if self.request_id:
            check_request_id("request_id", self.request_id)
        check_stops(self.stop)
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise InvalidArgument("max_tokens 0 asks for nothing: give max_tokens, or ask for the prompt's logprobs")
        if self.outline is not None and (self.top_logprobs, self.prompt_logprobs) != (None, None):
            raise InvalidArgument("logprobs are not available for an outline request (its answer is several sequences)")
        if self.json_schema and self.outline is not None:
            raise InvalidArgument("json_schema is for plain requests: an outline's answer is several sequences")
        if self.outline is not None:  # what an outline run would not honour is refused, not dropped
            given = [name for name, v in (("stop", self.stop), ("ignore_eos", self.ignore_eos),
                                          ("prefill_chunk", self.prefill_chunk)) if v]
            if given:
                raise InvalidArgument(f"{', '.join(given)}: not available for an outline request (its points are "
                                      "sequences of their own); send it as a plain request")
        if self.outline is not None and self.outline.max_points > MAX_POINTS:
            raise InvalidArgument(f"max_points {self.outline.max_points} is over the cap of {MAX_POINTS}")
        if self.outline is not None and len(self.outline.outline_text) > MAX_PROMPT_CHARS:
            raise InvalidArgument(f"outline_text is over the cap of {MAX_PROMPT_CHARS} characters")
