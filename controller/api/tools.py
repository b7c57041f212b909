"""Tool calls (OpenAI's `tools` / `tool_choice`) for the template families the mesh serves.

A family is how a model writes a call, chosen by its chat template:
- "qwen" (Qwen 2/2.5/3, Hermes, and the fallback): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
- "llama3" (Llama 3.1+: a template that renders `tools` and knows `<|python_tag|>` / ipython):
  a bare JSON object `{"name": ..., "parameters": {...}}` (several separated by ";").
A template that renders `tools=` gets them through the template; one that does not (SmolLM2's)
gets them in a system message written the qwen way, which is also how its answer is parsed.

`tool_choice: "required"` or a named function constrains the answer with the structured-output
grammar (stage_node.grammar): the answer is the call object itself, whose schema is
`call_schema`; "auto" parses whatever calls the answer holds; "none" leaves the tools out of the
prompt and parses nothing.
"""
from __future__ import annotations

import json
import re
import uuid

QWEN, LLAMA3 = "qwen", "llama3"
_QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def family(tokenizer) -> str:
    """The call format of the model behind `tokenizer`, from its chat template."""
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if "<|python_tag|>" in template or ("ipython" in template and "tools" in template):
        return LLAMA3
    return QWEN


def renders_tools(tokenizer) -> bool:
    """Whether the chat template itself lays out `tools` (else they go in a system message)."""
    return "tools" in str(getattr(tokenizer, "chat_template", "") or "")


def args_key(fam: str) -> str:
    return "parameters" if fam == LLAMA3 else "arguments"


def system_text(tools: list[dict]) -> str:
    """The tools as a system message, for a template that does not render them (qwen's wording)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function "
            "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def call_schema(tools: list[dict], name: str | None, fam: str) -> str:
    """The JSON schema of one call object (to one of `tools`, or to `name`): the grammar of an
    answer that must call a tool."""
    key = args_key(fam)
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                  key: f.get("parameters") or {"type": "object"}},
                "required": ["name", key], "additionalProperties": False}
               for f in (t["function"] for t in tools) if name is None or f["name"] == name]
    return json.dumps(options[0] if len(options) == 1 else {"anyOf": options})


def _call(obj, fam: str, names: set[str]) -> dict | None:
    """One parsed call object as OpenAI's tool_calls entry (None: not a call to a known tool)."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(args_key(fam), obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse(text: str, fam: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """An answer -> (its content besides the calls, or None; its tool calls, OpenAI's shape). An
    answer that is one bare call object (what the grammar forces, and llama3's form) is a call in
    either family."""
    names = {t["function"]["name"] for t in tools}
    stripped = text.strip().removeprefix("<|python_tag|>").strip()
    calls = []
    if fam == QWEN and "<tool_call>" in text:
        for m in _QWEN_CALL.finditer(text):
            try:
                call = _call(json.loads(m.group(1)), fam, names)
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        content = _QWEN_CALL.sub("", text).strip() if calls else text
        return (content or None) if calls else text, calls
    objs = _objects(stripped) if fam == LLAMA3 else _objects(stripped, 1)
    calls = [_call(o, fam, names) for o in objs or ()]
    if not calls or None in calls:
        return text, []
    return None, calls


def _objects(text: str, most: int = 64) -> list | None:
    """`text` as JSON values one after another (separated by space or ";"), at most `most`; None
    when it is anything else."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text) and len(out) < most:
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        out.append(obj)
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
    return out if i >= len(text) else None
