"""Service tier, the OpenAI API as clients use it (issue 24), with the official `openai` client
against the HTTP API of an in-process controller over one in-process stage holding the default
model (SmolLM2-135M-Instruct, CPU, float32), all on the module's event loop: GET /v1/models/{id},
the developer role, a batch of prompts, include_usage."""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import openai
import pytest
from aiohttp import web

from logicpipe.controller.http_api import HttpApi

from .conftest import Controller, Node, controller, stage_node

CALL_TIMEOUT_S = 120.0


@dataclass
class Served:
    node: Node
    ctl: Controller
    client: openai.AsyncOpenAI
    model: str


@contextlib.asynccontextmanager
async def served(model_dir):
    """One stage (all 30 layers), the controller, and its HTTP API on 127.0.0.1:<ephemeral>."""
    async with stage_node("openai-solo") as node, controller(model_dir, [node.address]) as ctl:
        runner = HttpApi(ctl.app, ctl.door).runner()
        await runner.setup()
        client = None
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            port = runner.addresses[0][1]
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                        timeout=CALL_TIMEOUT_S)
            yield Served(node, ctl, client, model_dir.name)
        finally:
            if client is not None:
                await client.close()
            await runner.cleanup()


@pytest.fixture(scope="module")
def api(runner, model_dir):
    stack = contextlib.AsyncExitStack()
    try:
        yield runner.run(asyncio.wait_for(stack.enter_async_context(served(model_dir)), CALL_TIMEOUT_S))
    finally:
        runner.run(stack.aclose())


def arun(runner, coro):
    return runner.run(asyncio.wait_for(coro, CALL_TIMEOUT_S))


def test_models_retrieve(runner, api):
    async def go():
        assert (await api.client.models.retrieve(api.model)).id == api.model
        with pytest.raises(openai.NotFoundError) as info:
            await api.client.models.retrieve("gpt-9")
        assert info.value.body["code"] == "model_not_found"
    arun(runner, go())


def test_developer_is_system_and_a_batch_is_its_prompts(runner, api):
    """A developer turn answers as a system turn (greedy: the same text); a batch of prompts gets,
    in choice i, what prompt i alone gets; a stream with include_usage ends with the usage."""
    async def go():
        c = api.client
        turns = [{"role": "user", "content": "Name a colour."}]
        answers = [(await c.chat.completions.create(model=api.model, max_tokens=8, temperature=0, messages=[
            {"role": role, "content": "You answer in one word."}, *turns])).choices[0].message.content
            for role in ("developer", "system")]
        assert answers[0] == answers[1] and answers[0]
        prompts = ["The capital of France is", "1, 2, 3, 4,"]
        alone = [(await c.completions.create(model=api.model, prompt=p, max_tokens=6, temperature=0)).choices[0].text
                 for p in prompts]
        batch = await c.completions.create(model=api.model, prompt=prompts, max_tokens=6, temperature=0)
        assert [ch.index for ch in batch.choices] == [0, 1] and [ch.text for ch in batch.choices] == alone
        assert batch.usage.completion_tokens == 12
        ids = api.ctl.app.tokenizer(prompts[1])["input_ids"]
        by_ids = await c.completions.create(model=api.model, prompt=[ids, ids], max_tokens=6, temperature=0)
        assert [ch.text for ch in by_ids.choices] == [alone[1]] * 2
        texts = {0: "", 1: ""}
        usage = None
        async for chunk in await c.completions.create(model=api.model, prompt=prompts, max_tokens=6, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}):
            for ch in chunk.choices:
                texts[ch.index] += ch.text
            usage = chunk.usage or usage
        assert [texts[0], texts[1]] == alone and usage.completion_tokens == 12
    arun(runner, go())
