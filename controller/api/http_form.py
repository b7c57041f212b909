"""OpenAI's response objects for the HTTP API (controller.http_api): the choices of one request
(one per completion: a batch of prompts, or the n sequences of one), whole or as stream chunks,
and the merge of their pieces as they come, so each choice streams at its own pace."""
from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

from aiohttp import web

from logicpipe.controller.api.logprobs import TokenText
from logicpipe.controller.jobs.door import Completion, Piece
from logicpipe.controller.api.tools import parse as tool_calls


class Form:
    """The response objects of one request whose choices are `completions` (choice i: the i-th)."""

    def __init__(self, model_id: str, chat: bool, completions: list[Completion], text: TokenText | None = None,
                 echo: list[str] | None = None):
        self.model_id, self.chat, self.cs, self.text = model_id, chat, completions, text or TokenText(None)
        self.echo = echo  # completions with `echo`: each choice's prompt text, which its text starts with
        self.id = ("chatcmpl-" if chat else "cmpl-") + completions[0].id[:24]
        self.created = int(time.time())
        self.kind = "chat.completion" if chat else "text_completion"
        self.started: set[int] = set()  # choices whose first chat delta (it carries the role) is out
        self.sent = [0] * len(completions)  # characters of each choice's text streamed (completions' text_offset)
        self.tools: tuple[str, list] | None = None  # chat with tools: (family, tools); answers parsed for calls

    @property
    def c(self) -> Completion:
        return self.cs[0]

    def outline(self) -> list[dict]:
        return [{"id": p.id, "title": p.title, "deps": list(p.deps), "text": p.text} for p in self.c.points]

    def chunk(self, delta: str, finish: str | None, *, index: int = 0, outline: bool = False,
              event_id: int | None = None, piece: Piece | None = None) -> bytes:
        """A stream chunk of choice `index`: its new text, and (asked for) its tokens' logprobs."""
        tokens = piece.token_ids if piece is not None and self.cs[index].top_logprobs is not None else ()
        if self.chat:
            content = ({"content": delta} if index in self.started else {"role": "assistant", "content": delta}) \
                if delta else {}
            choice = {"index": index, "delta": content, "finish_reason": finish}
            if tokens:
                choice["logprobs"] = {"content": self.text.chat(tokens, piece.logprobs)}
            if delta:
                self.started.add(index)
        else:
            choice = {"index": index, "text": delta, "finish_reason": finish,
                      "logprobs": self.text.completions(tokens, piece.logprobs, self.sent[index]) if tokens else None}
            self.sent[index] += sum(len(self.text.text(t)) for t in tokens) if tokens else 0
        obj = {"id": self.id, "object": self.kind + ".chunk" if self.chat else self.kind, "created": self.created,
               "model": self.model_id, "choices": [choice]}
        if outline:
            obj["outline"] = self.outline()
        head = f"id: {event_id}\n" if event_id is not None else ""
        return f"{head}data: {json.dumps(obj)}\n\n".encode()

    def echo_chunk(self, index: int) -> bytes:
        """A stream's first chunk of choice `index` with `echo`: its prompt (and the prompt's logprobs)."""
        c = self.cs[index]
        choice = {"index": index, "text": self.echo[index], "finish_reason": None,
                  "logprobs": self.text.echoed(c.prompt_ids, c.prompt_logprobs) if c.top_logprobs is not None else None}
        self.sent[index] = len(self.echo[index])
        obj = {"id": self.id, "object": self.kind, "created": self.created, "model": self.model_id, "choices": [choice]}
        return f"data: {json.dumps(obj)}\n\n".encode()

    def usage(self) -> dict:
        prompt = sum(c.prompt_tokens for c in self.cs if not c.shares_prompt)  # n choices: their prompt once
        n = sum(len(c.tokens) for c in self.cs)
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}

    def usage_chunk(self) -> bytes:
        """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
        obj = {"id": self.id, "object": self.kind + ".chunk" if self.chat else self.kind, "created": self.created,
               "model": self.model_id, "choices": [], "usage": self.usage()}
        return f"data: {json.dumps(obj)}\n\n".encode()

    def choice(self, index: int) -> dict:
        c = self.cs[index]
        reason = c.finish_reason or "length"
        asked = c.top_logprobs is not None
        if self.chat:
            message, reason = self.message(index)
            return {"index": index, "message": message, "finish_reason": reason,
                    "logprobs": {"content": self.text.chat(c.tokens, c.logprobs)} if asked else None}
        if self.echo is None:
            return {"index": index, "text": c.text, "finish_reason": reason,
                    "logprobs": self.text.completions(c.tokens, c.logprobs) if asked else None}
        prompt = self.echo[index]
        lps = None
        if asked:
            lps, more = self.text.echoed(c.prompt_ids, c.prompt_logprobs), self.text.completions(c.tokens, c.logprobs,
                                                                                                len(prompt))
            lps = {k: v + more[k] for k, v in lps.items()}
        return {"index": index, "text": prompt + c.text, "finish_reason": reason, "logprobs": lps}

    def message(self, index: int) -> tuple[dict, str]:
        """Chat choice `index`'s message and finish reason: with tools, the calls its answer holds
        (controller.tools) as tool_calls, finish_reason "tool_calls"."""
        c = self.cs[index]
        reason = c.finish_reason or "length"
        if self.tools is None:
            return {"role": "assistant", "content": c.text}, reason
        content, calls = tool_calls(c.text, *self.tools)
        if not calls:
            return {"role": "assistant", "content": c.text}, reason
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    def whole_chunk(self, index: int) -> bytes:
        """A chat choice with tools, streamed whole: its message as one delta (calls indexed), and its finish."""
        message, reason = self.message(index)
        if "tool_calls" in message:
            message["tool_calls"] = [{"index": j, **call} for j, call in enumerate(message["tool_calls"])]
        obj = {"id": self.id, "object": self.kind + ".chunk", "created": self.created, "model": self.model_id,
               "choices": [{"index": index, "delta": message, "finish_reason": reason}]}
        return f"data: {json.dumps(obj)}\n\n".encode()

    def whole(self, *, outline: bool = False) -> dict:
        obj = {"id": self.id, "object": self.kind, "created": self.created, "model": self.model_id,
               "choices": [self.choice(i) for i in range(len(self.cs))], "usage": self.usage()}
        if outline:
            obj["outline"] = self.outline()
        return obj


async def merged(completions: list[Completion]) -> AsyncIterator[tuple[int, Piece]]:
    """(choice index, piece) of every completion as they come; an error of one ends them all.
    Each completion is read by its own task; they are all done when this ends, so the front door
    may close the completions right after."""
    if len(completions) == 1:
        async for piece in completions[0]:
            yield 0, piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, c: Completion) -> None:
        try:
            async for piece in c:
                await queue.put((i, piece, None))
            await queue.put((i, None, None))
        except Exception as exc:  # noqa: BLE001 — handed to the reader, which raises it
            await queue.put((i, None, exc))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(completions)]
    try:
        left = len(tasks)
        while left:
            i, piece, exc = await queue.get()
            if exc is not None:
                raise exc
            if piece is None:
                left -= 1
            else:
                yield i, piece
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def open_stream(request, request_id: str = "") -> web.StreamResponse:
    """A server-sent-events response, headers sent."""
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    if request_id:
        headers["X-Request-Id"] = request_id
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    return response


async def close_stream(response: web.StreamResponse) -> web.StreamResponse:
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
