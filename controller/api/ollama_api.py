"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/version`) as a
translation to and from the chat (and completions) path.

In: /api/chat's `messages` (system, user, assistant with `tool_calls`, tool with `tool_name`),
`tools` (OpenAI's function tools), `format` ("json" or a JSON schema: chat's response_format),
`options` (temperature, top_p, top_k, seed, num_predict: max_tokens, stop, presence_penalty,
frequency_penalty), `logprobs` / `top_logprobs`, `stream` (true unless false, as Ollama's),
`keep_alive` (taken: the mesh keeps its model loaded), `think` only false. /api/generate's
`prompt` through the chat template with `system`, or `raw` as is (chat's completions path);
an empty prompt answers at once with done_reason "load", as Ollama's does. The model is named as
/api/tags lists it (`NAME`, or `NAME:latest`). Images, `suffix`, `template`, `context`, other
options (num_ctx, repeat_penalty, mirostat, ...) are refused by name: {"error": "..."}, 400.

Out: Ollama's objects — `message` (content, tool_calls with arguments as objects) or `response`,
`done`, `done_reason` (stop, length), prompt_eval_count / eval_count and the durations in
nanoseconds; streamed as NDJSON, one object a line, the last with done true and the counts.
"""
from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from logicpipe.common.modeldir import safetensors_files, safetensors_header
from logicpipe.controller.api.dialect import Asked, call_arguments, check_model, iso_now, items, known, obj, text
from logicpipe.controller.api.http_body import ApiError, boolean
from logicpipe.controller.api.http_form import Form
from logicpipe.controller.jobs.door import Completion, Piece

VERSION = "0.12.0"  # the Ollama release whose API this follows (GET /api/version): clients check it for features
COMMON = {"model", "format", "options", "stream", "keep_alive", "logprobs", "top_logprobs"}
CHAT_FIELDS = COMMON | {"messages", "tools"}
GENERATE_FIELDS = COMMON | {"prompt", "system", "raw"}
NOOP = {"think": (False,), "images": ([],), "suffix": ("",), "template": ("",), "context": ([],)}
OPTIONS = {"temperature", "top_p", "top_k", "seed", "num_predict", "stop", "presence_penalty", "frequency_penalty"}
RENAMED = {"max_tokens": "options.num_predict", "response_format": "format", "messages": "=messages",
           **{name: f"options.{name}" for name in OPTIONS - {"num_predict"}}}


def error_body(err: ApiError) -> dict:
    return {"error": str(err)}


def names(model_id: str) -> tuple[str, ...]:
    return (model_id, f"{model_id}:latest")


def asked(body: dict, model_id: str, generate: bool) -> Asked:
    """An /api/chat or /api/generate body as a chat (or, raw, completions) body."""
    known(body, GENERATE_FIELDS if generate else CHAT_FIELDS, NOOP)
    check_model(body.get("model"), model_id, names(model_id), required=True)
    stream = boolean(body, "stream", default=True)
    echo = {"model": body["model"], "generate": generate}
    kind = "chat"
    if generate:
        prompt = body.get("prompt") or ""
        if not text(prompt, "prompt"):  # Ollama's way to load a model: nothing to generate
            return Asked({}, False, echo=echo, answer={"model": body["model"], "created_at": iso_now(), "response": "",
                                                       "done": True, "done_reason": "load"})
        if boolean(body, "raw"):
            if body.get("system"):
                raise ApiError(400, "system is not taken with raw (a raw prompt is sent as is)", param="system")
            chat, kind = {"prompt": prompt}, "completions"
        else:
            system = [] if not body.get("system") else [{"role": "system", "content": text(body["system"], "system")}]
            chat = {"messages": system + [{"role": "user", "content": prompt}]}
    else:
        chat = {"messages": [message(m, f"messages[{i}]") for i, m in enumerate(items(body.get("messages"),
                                                                                        "messages"))]}
        if body.get("tools"):
            chat["tools"] = items(body["tools"], "tools")
    chat.update(options(body.get("options")))
    fmt = body.get("format")
    if fmt == "json":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise ApiError(400, 'format must be "json" or a JSON schema (an object)', param="format")
    if boolean(body, "logprobs") or body.get("top_logprobs") is not None:
        if kind == "completions":
            chat["logprobs"] = body.get("top_logprobs") or 0
        else:
            chat["logprobs"], chat["top_logprobs"] = True, body.get("top_logprobs")
    return Asked(chat, stream, kind, RENAMED, echo)


def options(given) -> dict:
    """Ollama's options as chat fields (num_predict: max_tokens)."""
    if given is None:
        return {}
    known(obj(given, "options"), OPTIONS, where="options")
    out = {k: v for k, v in given.items() if v is not None}
    if "num_predict" in out:
        n = out.pop("num_predict")
        if isinstance(n, int) and not isinstance(n, bool) and n < 1:  # Ollama's -1: no limit; -2: fill the context
            raise ApiError(400, f"options.num_predict {n} is not supported by this server: give the most tokens "
                           "to generate (1 or more)", param="options.num_predict")
        out["max_tokens"] = n
    return out


def message(m, where: str) -> dict:
    """One Ollama message as a chat message: tool_calls' arguments (objects) as JSON text, a tool
    turn's tool_name as its call's id."""
    known(obj(m, where), {"role", "content", "tool_calls", "tool_name", "tool_call_id"},
          {"images": ([],), "thinking": ("",)}, where)
    role = m.get("role")
    out = {"role": role, "content": text(m.get("content") or "", f"{where}.content")}
    if m.get("tool_calls"):
        calls = []
        for j, call in enumerate(items(m["tool_calls"], f"{where}.tool_calls")):
            w = f"{where}.tool_calls[{j}]"
            known(obj(call, w), {"function", "id", "type"}, where=w)
            fn = obj(call.get("function"), f"{w}.function")
            known(fn, {"name", "arguments", "index"}, where=f"{w}.function")
            calls.append({"id": str(call.get("id") or f"call_{j}"), "type": "function", "function": {
                "name": text(fn.get("name"), f"{w}.function.name"),
                "arguments": json.dumps(obj(fn.get("arguments", {}), f"{w}.function.arguments"))}})
        out.update(tool_calls=calls, content=m.get("content") or None)
    if role == "tool":
        out["tool_call_id"] = str(m.get("tool_call_id") or m.get("tool_name") or "tool")
    return out


class Reply:
    """The answer to one /api/chat or /api/generate request, whole or as NDJSON lines."""

    content_type = "application/x-ndjson"

    def __init__(self, model_id: str, completion: Completion, form: Form, asked: Asked):
        self.c, self.form = completion, form
        self.model, self.generate = asked.echo["model"], asked.echo["generate"]
        self.logprobs = completion.top_logprobs is not None

    def _line(self, said: str, done: bool, calls=(), tokens=(), lps=()) -> dict:
        out = {"model": self.model, "created_at": iso_now()}
        if self.generate:
            out["response"] = said
        else:
            out["message"] = {"role": "assistant", "content": said}
            if calls:
                out["message"]["tool_calls"] = [{"function": {"name": call["function"]["name"],
                                                              "arguments": call_arguments(call)}} for call in calls]
        if self.logprobs and tokens:
            out["logprobs"] = self.form.text.chat(tokens, lps)
        out["done"] = done
        return out

    def _done(self, line: dict) -> dict:
        """The last line's finish and counts (Ollama's durations are nanoseconds)."""
        t = self.c.timings()
        ns = (lambda s: int(s * 1e9)) if t is not None else (lambda s: 0)
        line.update(done_reason="length" if self.c.finish_reason == "length" else "stop",
                    total_duration=ns(t.total_s if t else 0), load_duration=0,
                    prompt_eval_count=self.c.prompt_tokens,
                    prompt_eval_duration=ns(t.first_token_s - t.queue_s if t else 0),
                    eval_count=len(self.c.tokens), eval_duration=ns(t.total_s - t.first_token_s if t else 0))
        return line

    def whole(self) -> dict:
        if self.generate:
            return self._done(self._line(self.c.text, True, (), self.c.tokens, self.c.logprobs))
        message, _ = self.form.message(0)
        return self._done(self._line(message["content"] or "", True, message.get("tool_calls", ()), self.c.tokens,
                                     self.c.logprobs))

    def head(self) -> bytes:
        return b""

    def delta(self, piece: Piece) -> bytes:
        return self._ndjson(self._line(piece.text, False, (), piece.token_ids, piece.logprobs))

    def tail(self) -> bytes:
        out = b""
        if self.form.tools is not None:  # parsed for calls once whole: the answer in one line
            message, _ = self.form.message(0)
            out = self._ndjson(self._line(message["content"] or "", False, message.get("tool_calls", ()),
                                          self.c.tokens, self.c.logprobs))
        return out + self._ndjson(self._done(self._line("", True)))

    def failed(self, err: ApiError) -> bytes:
        return self._ndjson(error_body(err))

    @staticmethod
    def _ndjson(obj: dict) -> bytes:
        return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


@dataclass(frozen=True)
class ModelCard:
    """What /api/tags and /api/show tell of the model (read once from its directory)."""

    name: str
    family: str           # config.json's model_type
    config: object        # common.modeldir.ModelConfig
    parameters: int       # elements of every tensor
    dtype: str            # the weights' most common safetensors dtype ("F32", "BF16")
    size: int             # bytes of the weight files
    digest: str           # the model digest (common.modeldir.model_digest)
    modified: float       # the weights' newest mtime, seconds since the epoch
    template: str = ""    # the chat template

    def details(self) -> dict:
        n = self.parameters
        return {"parent_model": "", "format": "safetensors", "family": self.family, "families": [self.family],
                "parameter_size": f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M",
                "quantization_level": self.dtype}

    def modified_at(self) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.modified))

    def tags(self) -> dict:
        return {"models": [{"name": self.name, "model": self.name, "modified_at": self.modified_at(),
                            "size": self.size, "digest": self.digest, "details": self.details()}]}

    def show(self) -> dict:
        f, c = self.family, self.config
        return {"license": "", "modelfile": f"# served by a LogicPipe mesh\nFROM {self.name}\n", "parameters": "",
                "template": self.template, "details": self.details(),
                "model_info": {"general.architecture": f, "general.basename": self.name,
                               "general.parameter_count": self.parameters, f"{f}.block_count": c.num_layers,
                               f"{f}.context_length": c.max_position_embeddings,
                               f"{f}.embedding_length": c.hidden_size, f"{f}.attention.head_count": c.num_heads,
                               f"{f}.attention.head_count_kv": c.num_kv_heads, f"{f}.vocab_size": c.vocab_size},
                "capabilities": ["completion", "tools"], "modified_at": self.modified_at()}


def model_card(model_dir: Path, config, digest: str, template: str) -> ModelCard:
    files = safetensors_files(model_dir)
    tensors = [meta for f in files for name, meta in safetensors_header(f).items() if name != "__metadata__"]
    dtypes = Counter(meta["dtype"] for meta in tensors)
    return ModelCard(model_dir.name, config.model_type, config, sum(math.prod(m["shape"]) for m in tensors),
                     dtypes.most_common(1)[0][0] if dtypes else "", sum(f.stat().st_size for f in files), digest,
                     max((f.stat().st_mtime for f in files), default=0.0), template)
