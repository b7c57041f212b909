"""Service tier, the OpenAI API as clients use it (issue 24), with the official `openai` client
against the HTTP API of an in-process controller over one in-process stage holding the default
model (SmolLM2-135M-Instruct, CPU, float32), all on the module's event loop: GET /v1/models/{id},
the developer role, a batch of prompts, include_usage; logprobs against transformers' own forward
of the same tokens (within LOGPROB_TOL), candidates and sampled tokens included; penalties and
logit_bias against transformers' greedy with them applied by hand; echo's prompt logprobs; n choices
forked from one prefill."""
from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from dataclasses import dataclass

import openai
import pytest
from aiohttp import web

from logicpipe.controller.api.http_api import HttpApi
from logicpipe.controller.api.logprobs import TokenText
from logicpipe.sampling import TokenLogprob
from logicpipe.v1 import controller_pb2, stage_pb2

from .conftest import Controller, Node, controller, stage_node

CALL_TIMEOUT_S = 120.0
LOGPROB_TOL = 2e-3  # |ours - transformers'|, nats: CPU float32, our paged attention vs HF's eager one
REPEATING = "hello hello hello hello hello hello hello"  # greedy goes on " hello" (4 more times)
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,"  # candidates accepted


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


@pytest.fixture(scope="module")
def hf(model_dir):
    """transformers' own model of the default model, float32 on the CPU (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf, prompt: list[int], tokens: list[int]):
    """log-softmax of transformers' logits at each new token's position: [len(tokens), vocab]."""
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: len(prompt) + len(tokens) - 1]
    return torch.log_softmax(logits.float(), -1)


def worst_difference(ref, tokens: list[int], got: list[TokenLogprob], top: int) -> float:
    """The largest |ours - transformers'| over each token's logprob and its top ones, asserting
    that the top ones are transformers' top ids (ties aside), most likely first."""
    worst = 0.0
    for row, t, lp in zip(ref, tokens, got):
        worst = max(worst, abs(float(row[t]) - lp.logprob))
        assert len(lp.top) == top
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        want = row.topk(top)
        for (i, v), wi, wv in zip(lp.top, want.indices.tolist(), want.values.tolist()):
            assert i == wi or abs(float(row[i]) - wv) < LOGPROB_TOL, (i, wi)
            worst = max(worst, abs(float(row[i]) - v))
        if lp.logprob >= values[-1] + LOGPROB_TOL:  # the chosen token is in the top N: listed there
            assert t in [i for i, _ in lp.top]
    return worst


async def submit(ctl: Controller, **fields) -> tuple[list[int], list[TokenLogprob], controller_pb2.Timings]:
    replies = [r async for r in ctl.stub.Submit(controller_pb2.SubmitRequest(**fields), timeout=CALL_TIMEOUT_S)]
    return ([t for r in replies for t in r.token_ids], [TokenLogprob.from_proto(lp) for r in replies for lp in r.logprobs],
            replies[-1].timings)


def test_logprobs_equal_a_transformers_forward(runner, api, hf):
    """gRPC Submit and both HTTP APIs: each token's logprob and its top N are transformers'
    log-softmax at its position: greedy with candidates (accepted ones' from their verification
    rows), and seeded sampling (the raw distribution, not the tempered one)."""
    async def go():
        tok = api.ctl.app.tokenizer
        prompt = tok(COUNTING)["input_ids"]
        worst = 0.0
        greedy, lps, timings = await submit(api.ctl, prompt_token_ids=prompt, max_tokens=16, speculate=4, top_logprobs=5,
                                            ignore_eos=True)
        assert timings.accepted > 0 and len(lps) == len(greedy) == 16  # some tokens were accepted candidates
        worst = max(worst, worst_difference(hf_logprobs(hf, prompt, greedy), greedy, lps, 5))
        assert all(lp.top[0][0] == t for t, lp in zip(greedy, lps))  # greedy: the most likely
        sampled, lps, _ = await submit(api.ctl, prompt_token_ids=prompt, max_tokens=12, top_logprobs=3, ignore_eos=True,
                                       sampling=stage_pb2.SamplingParams(temperature=1.5, seed=7), speculate=0)
        assert sampled != greedy[:12]
        worst = max(worst, worst_difference(hf_logprobs(hf, prompt, sampled), sampled, lps, 3))
        # HTTP, completions (whole and streamed): the same numbers as gRPC for the same tokens
        text = TokenText(tok)
        ref = hf_logprobs(hf, prompt, greedy)
        for stream in (False, True):
            r = await api.client.completions.create(model=api.model, prompt=prompt, max_tokens=16, temperature=0,
                                                    logprobs=5, stream=stream, extra_body={"speculate": 4,
                                                                                           "ignore_eos": True})
            if stream:
                tokens, values, tops = [], [], []
                async for chunk in r:
                    if chunk.choices and chunk.choices[0].logprobs:
                        tokens += chunk.choices[0].logprobs.tokens
                        values += chunk.choices[0].logprobs.token_logprobs
                        tops += chunk.choices[0].logprobs.top_logprobs
            else:
                lp = r.choices[0].logprobs
                tokens, values, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
            assert tokens == [text.text(t) for t in greedy]
            worst = max(worst, max(abs(float(ref[i, t]) - v) for i, (t, v) in enumerate(zip(greedy, values))))
            assert all(len(t) == 5 and t[s] == v for t, s, v in zip(tops, tokens, values))
        # HTTP, chat: content entries, top_logprobs ordered, the chosen token first (greedy)
        r = await api.client.chat.completions.create(model=api.model, max_tokens=8, temperature=0, logprobs=True,
                                                     top_logprobs=4,
                                                     messages=[{"role": "user", "content": "Count to ten."}])
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens
        for e in content:
            assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
            assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        if r.choices[0].finish_reason == "length":
            assert bytes(b for e in content for b in e.bytes).decode() == r.choices[0].message.content
        print(f"logprobs: max |ours - transformers'| = {worst:.2e} nats")
        assert worst < LOGPROB_TOL
    arun(runner, go())


def hf_penalized(hf, prompt: list[int], n: int, presence: float = 0.0, frequency: float = 0.0,
                 bias: dict[int, float] | None = None) -> list[int]:
    """n greedy tokens by transformers with OpenAI's penalties and logit_bias applied by hand
    (on the tokens generated so far): the specification the mesh must meet."""
    import torch

    out: list[int] = []
    ids, past = torch.tensor([prompt]), None
    with torch.no_grad():
        for _ in range(n):
            step = hf(ids, past_key_values=past, use_cache=True)
            past, logits = step.past_key_values, step.logits[0, -1].float()
            for t, b in (bias or {}).items():
                logits[t] += b
            for t, c in Counter(out).items():
                logits[t] -= c * frequency + presence
            out.append(int(logits.argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


async def http_tokens(api: Served, prompt: list[int], n: int, **fields) -> list[str]:
    """The texts of the n tokens the completions API answers (greedy, past EOS), by its logprobs."""
    extra = {"ignore_eos": True, **fields.pop("extra_body", {})}
    r = await api.client.completions.create(model=api.model, prompt=prompt, max_tokens=n, temperature=0, logprobs=0,
                                            extra_body=extra, **fields)
    return r.choices[0].logprobs.tokens


def test_penalties_and_logit_bias_change_sampling_as_specified(runner, api, hf):
    """logit_bias -100 on greedy's first token changes it, +100 on a token forces it; presence and
    frequency penalties give transformers' greedy with the penalties applied by hand, with
    candidates as without; a seeded sampled request with penalties gives the same tokens with
    candidates as without (the penalties depend only on the tokens so far: replays stay exact)."""
    async def go():
        tok = api.ctl.app.tokenizer
        text = TokenText(tok)
        prompt = tok(COUNTING)["input_ids"]
        plain = hf_penalized(hf, prompt, 8)
        banned = hf_penalized(hf, prompt, 8, bias={plain[0]: -100.0})
        assert banned[0] != plain[0]
        got = await http_tokens(api, prompt, 8, logit_bias={str(plain[0]): -100})
        assert got == [text.text(t) for t in banned]
        forced = tok(" Paris", add_special_tokens=False)["input_ids"][0]
        got = await http_tokens(api, prompt, 4, logit_bias={str(forced): 100})
        assert got == [text.text(forced)] * 4
        prompt = tok(REPEATING)["input_ids"]  # greedy repeats " hello": the penalties make it stop
        want = hf_penalized(hf, prompt, 10, presence=0.5, frequency=0.5)
        assert want != hf_penalized(hf, prompt, 10)
        for speculate in (0, 4):
            got = await http_tokens(api, prompt, 10, presence_penalty=0.5, frequency_penalty=0.5,
                                    extra_body={"speculate": speculate})
            assert got == [text.text(t) for t in want], speculate
        sampling = stage_pb2.SamplingParams(temperature=0.8, seed=11, presence_penalty=1.0, frequency_penalty=1.0)
        runs = [(await submit(api.ctl, prompt_token_ids=prompt, max_tokens=16, ignore_eos=True, sampling=sampling,
                              speculate=k))[0] for k in (0, 4)]
        assert runs[0] == runs[1]
    arun(runner, go())


def test_echo_prompt_logprobs_equal_a_transformers_forward(runner, api, hf):
    """What loglikelihood evaluation asks (echo, max_tokens 0 or 1, logprobs): every prompt token
    but the first with transformers' log-softmax of the position before it, also when the prompt
    is in the prefix cache already (the last stage computes it in full); gRPC the same."""
    async def go():
        import torch

        tok = api.ctl.app.tokenizer
        prompt = tok(COUNTING)["input_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
        want = [float(ref[i - 1, t]) for i, t in enumerate(prompt) if i]
        worst = 0.0
        for max_tokens in (0, 1, 0):  # the third: its blocks are in the prefix cache
            r = await api.client.completions.create(model=api.model, prompt=COUNTING, echo=True, max_tokens=max_tokens,
                                                    logprobs=2, temperature=0)
            lp = r.choices[0].logprobs
            assert r.choices[0].text.startswith(COUNTING) and lp.token_logprobs[0] is None
            got = lp.token_logprobs[1:len(prompt)]
            assert len(got) == len(want) and len(lp.tokens) == len(prompt) + max_tokens
            worst = max(worst, max(abs(a - b) for a, b in zip(got, want)))
            for i, top in enumerate(lp.top_logprobs[1:len(prompt)]):
                assert len(top) == 2 and list(top.values()) == sorted(top.values(), reverse=True)
                assert abs(max(top.values()) - float(ref[i].max())) < LOGPROB_TOL
        replies = [r async for r in api.ctl.stub.Submit(controller_pb2.SubmitRequest(
            prompt_token_ids=prompt, max_tokens=1, prompt_logprobs=0), timeout=CALL_TIMEOUT_S)]
        got = [lp.logprob for lp in replies[0].prompt_logprobs]
        worst = max(worst, max(abs(a - b) for a, b in zip(got, want)))
        assert len(got) == len(want) and not any(r.prompt_logprobs for r in replies[1:])
        print(f"echo: max |ours - transformers'| = {worst:.2e} nats")
        assert worst < LOGPROB_TOL
    arun(runner, go())


async def rows_computed(node: Node) -> int:
    return (await node.stub.Status(stage_pb2.StatusRequest(), timeout=CALL_TIMEOUT_S)).tokens


def test_n_choices_from_one_prefill(runner, api):
    """n = 3: greedy gives 3 equal answers, seeded sampling 3 different ones (choice 0 the answer
    of n = 1 with that seed); the stage computed the prompt once: its rows are the prompt's, then
    each choice's own (its prompt's last row again, and a row per token after its first)."""
    async def go():
        c = api.client
        prompt = f"Zebra {uuid.uuid4().hex[:8]} says: the best colour is"  # not in the prefix cache
        n_prompt = len(api.ctl.app.tokenizer(prompt)["input_ids"])
        before = await rows_computed(api.node)
        r = await c.completions.create(model=api.model, prompt=prompt, n=3, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True, "speculate": 0})
        rows = await rows_computed(api.node) - before
        assert [ch.index for ch in r.choices] == [0, 1, 2] and len({ch.text for ch in r.choices}) == 1
        assert rows == n_prompt + 3 * 6, (rows, n_prompt)  # without the fork: 3 x (n_prompt + 5)
        assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 18
        messages = [{"role": "user", "content": "Write a word."}]
        r = await c.chat.completions.create(model=api.model, messages=messages, n=3, max_tokens=8, temperature=1.0,
                                            seed=5)
        texts = [ch.message.content for ch in r.choices]
        assert len(set(texts)) == 3, texts
        one = await c.chat.completions.create(model=api.model, messages=messages, max_tokens=8, temperature=1.0, seed=5)
        assert one.choices[0].message.content == texts[0]
        streamed = {0: "", 1: "", 2: ""}
        async for chunk in await c.chat.completions.create(model=api.model, messages=messages, n=3, max_tokens=8,
                                                           temperature=1.0, seed=5, stream=True):
            for ch in chunk.choices:
                streamed[ch.index] += ch.delta.content or ""
        assert [streamed[i] for i in range(3)] == texts
    arun(runner, go())


def test_logprobs_through_two_stages(runner, model_dir, hf):
    """Two stages ([0, 15), [15, 30)), the prompt already in stage 0's prefix cache: the last
    stage still computes every prompt row for the prompt's logprobs, and the tokens' and the
    prompt's logprobs are transformers' (gRPC Submit)."""
    async def go():
        import torch

        async with stage_node("lp-first") as first, stage_node("lp-last") as last, \
                controller(model_dir, [first.address, last.address]) as ctl:
            prompt = ctl.app.tokenizer(COUNTING)["input_ids"]
            fields = dict(prompt_token_ids=prompt, max_tokens=6, top_logprobs=1, prompt_logprobs=1, ignore_eos=True)
            for _ in range(2):  # the second: stage 0 attaches the prompt's blocks from its prefix cache
                replies = [r async for r in ctl.stub.Submit(controller_pb2.SubmitRequest(**fields),
                                                            timeout=CALL_TIMEOUT_S)]
                tokens = [t for r in replies for t in r.token_ids]
                with torch.no_grad():
                    ref = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0].float(), -1)
                got = [lp.logprob for lp in replies[0].prompt_logprobs] + [lp.logprob for r in replies
                                                                           for lp in r.logprobs]
                want = [float(ref[i - 1, t]) for i, t in enumerate(prompt + tokens) if i]
                assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < LOGPROB_TOL
            hits = [(await n.stub.Status(stage_pb2.StatusRequest(), timeout=CALL_TIMEOUT_S)).prefix_hit_tokens
                    for n in (first, last)]
            assert hits[0] > 0 and hits[1] == 0, hits
    arun(runner, go())
