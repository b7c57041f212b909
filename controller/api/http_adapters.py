"""The HTTP API's adapters of other APIs over the chat path (controller.http_api):

    POST /v1/messages     Anthropic Messages (controller.anthropic_messages)
    POST /v1/responses    OpenAI Responses (controller.openai_responses)
    POST /api/chat        Ollama chat, and POST /api/generate (controller.ollama_api)
    GET  /api/tags, POST /api/show, GET /api/version   Ollama's model list, model card, version

A request is taken as the chat path takes one: its key first (`Authorization: Bearer` or
Anthropic's `X-Api-Key`; /api/* needs one too when there are keys), the client's place, the body;
then the adapter translates the body into an OpenAI chat body (a refusal names the adapter's own
field) and HttpApi.opened runs it through the same front door — caps, tokenizing, the chat
template, tools, structured output, journaling — and the completion goes back in the adapter's
shapes, whole or as its stream. An error is answered in the shape of the API its path belongs to.
"""
from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from logicpipe.controller.api import anthropic_messages, ollama_api, openai_responses
from logicpipe.controller.api.dialect import check_model, known, renamed
from logicpipe.controller.api.http_body import ApiError, mesh_error
from logicpipe.errors import MeshError

ADAPTED = [("POST", "/v1/messages"), ("POST", "/v1/responses"), ("POST", "/api/chat"), ("POST", "/api/generate"),
           ("GET", "/api/tags"), ("POST", "/api/show"), ("GET", "/api/version")]


def error_body(path: str, err: ApiError) -> dict:
    """`err` in the error shape of the API `path` belongs to (OpenAI's for every other path)."""
    if path == "/v1/messages":
        return anthropic_messages.error_body(err)
    if path.startswith("/api/"):
        return ollama_api.error_body(err)
    return err.body()


class Adapters:
    """The routes of the adapted APIs, over `api` (an HttpApi)."""

    def __init__(self, api):
        self.api = api
        self._card: ollama_api.ModelCard | None = None

    def handlers(self) -> dict:
        return {"/v1/messages": self.messages, "/v1/responses": self.responses, "/api/chat": self.ollama_chat,
                "/api/generate": self.ollama_generate, "/api/tags": self.ollama_tags, "/api/show": self.ollama_show,
                "/api/version": self.ollama_version}

    async def messages(self, request):
        return await self._serve(request, "messages", anthropic_messages.asked, anthropic_messages.Reply)

    async def responses(self, request):
        return await self._serve(request, "responses", openai_responses.asked, openai_responses.Reply)

    async def ollama_chat(self, request):
        return await self._serve(request, "ollama", lambda body, model: ollama_api.asked(body, model, False),
                                 ollama_api.Reply)

    async def ollama_generate(self, request):
        return await self._serve(request, "ollama", lambda body, model: ollama_api.asked(body, model, True),
                                 ollama_api.Reply)

    async def _serve(self, request, api: str, translate, make_reply):
        """One request of an adapted API: translated, run on the chat path, answered in its shapes."""
        http = self.api
        client = http.admit(request)
        async with http.door.admit(client):  # before the body: a client's uploads count toward its cap
            asked = translate(await http.read_body(request), http.model_id)
            if asked.answer is not None:
                return web.json_response(asked.answer)
            async with contextlib.AsyncExitStack() as held:
                try:
                    completion, form = await held.enter_async_context(
                        http.opened(request, client, asked.body, asked.kind, api))
                except ApiError as err:
                    raise renamed(err, asked.renamed) from None
                reply = make_reply(http.model_id, completion, form, asked)
                headers = {"X-Request-Id": completion.id}
                if not asked.stream:
                    async for _ in completion:
                        pass
                    return web.json_response(reply.whole(), headers=headers)
                return await self._stream(request, completion, form, reply, headers)

    async def _stream(self, request, completion, form, reply, headers: dict) -> web.StreamResponse:
        """The reply's events as the pieces come (with tools: all at the end, parsed for calls);
        opened with the first piece, so an error before it is still answered with its status."""
        response = None
        try:
            async for piece in completion:
                if form.tools is None and (piece.text or piece.token_ids):
                    response = response or await self._open(request, reply, headers)
                    await response.write(reply.delta(piece))
        except (MeshError, ApiError) as exc:
            if response is None:
                raise
            await response.write(reply.failed(exc if isinstance(exc, ApiError) else mesh_error(exc)))
            await response.write_eof()
            return response
        response = response or await self._open(request, reply, headers)
        await response.write(reply.tail())
        await response.write_eof()
        return response

    @staticmethod
    async def _open(request, reply, headers: dict) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": reply.content_type, "Cache-Control": "no-cache",
                                               **headers})
        await response.prepare(request)
        head = reply.head()
        if head:
            await response.write(head)
        return response

    # ---- Ollama's model routes -----------------------------------------------------------------
    async def card(self) -> ollama_api.ModelCard:
        """The model's card, read once (safetensors headers: off the event loop)."""
        if self._card is None:
            app = self.api.app
            template = str(getattr(self.api.door.tokenizer, "chat_template", "") or "")
            self._card = await asyncio.to_thread(ollama_api.model_card, app.model_dir, app.config, app.digest, template)
        return self._card

    async def ollama_tags(self, request):
        return web.json_response((await self.card()).tags())

    async def ollama_show(self, request):
        body = await self.api.read_body(request)
        known(body, {"model", "name", "verbose"})
        check_model(body.get("model", body.get("name")), self.api.model_id, ollama_api.names(self.api.model_id),
                    required=True)
        return web.json_response((await self.card()).show())

    async def ollama_version(self, request):
        return web.json_response({"version": ollama_api.VERSION})
