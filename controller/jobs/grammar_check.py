"""Structured output's admission check: a JSON schema is refused at the door when the grammar
library refuses it (logicpipe.sampling.check_grammar) and also when its grammar can never be
satisfied — it admits no text at all (`{"$ref": "#"}`: a value that is itself, forever; a required
property whose value is the whole schema again) or only the empty text (`{"anyOf": []}`), so that
such a request costs no stage anything and is the client's error, not a mesh fault.

How: the grammar xgrammar builds from the schema, in its EBNF form, is read into expressions and
the rules that can derive a finite text (and a non-empty one) are found by the usual fixed point
(a rule is productive once one of its alternatives is made of productive parts). A form this
reader does not know (a later xgrammar's) counts as productive: the check can only refuse what it
has shown to be empty. The verdict of a schema is cached (a client sends the same schema again
and again); it takes milliseconds, run off the event loop by the door.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from logicpipe.sampling import JSON_OBJECT, check_grammar

log = logging.getLogger(__name__)

CACHED_VERDICTS = 256  # schemas whose verdict is kept


@dataclass(frozen=True)
class Expr:
    kind: str            # "lit" (text: its length), "any" (a character class, a call), "ref", "seq", "alt",
                         # "rep" (lo: the least repeats), "look" (a lookahead: consumes nothing)
    parts: tuple = ()    # seq, alt: the expressions; rep, look: one
    name: str = ""       # ref: the rule
    size: int = 0        # lit: characters of the text; rep: the least repeats


class _Reader:
    """One rule body of xgrammar's printed EBNF, as an Expr."""

    def __init__(self, text: str):
        self.s, self.i = text, 0

    def peek(self) -> str:
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1
        return self.s[self.i] if self.i < len(self.s) else ""

    def alt(self) -> Expr:
        options = [self.seq()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.seq())
        return options[0] if len(options) == 1 else Expr("alt", tuple(options))

    def seq(self) -> Expr:
        items = []
        while self.peek() not in ("", "|", ")"):
            items.append(self.postfix(self.atom()))
        return items[0] if len(items) == 1 else Expr("seq", tuple(items))

    def atom(self) -> Expr:
        c = self.peek()
        if c == "(":
            self.i += 1
            look = self.s.startswith("=", self.i)
            self.i += look
            inner = self.alt()
            self.expect(")")
            return Expr("look", (inner,)) if look else inner
        if c and c in "\"[":
            end = self.closing(c, "\"" if c == "\"" else "]")
            body, self.i = self.s[self.i + 1:end], end + 1
            return Expr("lit", size=len(body)) if c == "\"" else Expr("any")
        start = self.i
        while self.i < len(self.s) and (self.s[self.i].isalnum() or self.s[self.i] == "_"):
            self.i += 1
        if self.i == start:
            raise ValueError(f"unexpected {c!r} at {self.i}")
        name = self.s[start:self.i]
        if self.s.startswith("(", self.i):  # a built-in form, Regex("...", ...): taken as productive
            self.i = self.balanced(self.i)
            return Expr("any")
        return Expr("ref", name=name)

    def postfix(self, e: Expr) -> Expr:
        c = self.peek()
        if c and c in "*?":
            self.i += 1
            return Expr("rep", (e,), size=0)
        if c == "+":
            self.i += 1
            return Expr("rep", (e,), size=1)
        if c == "{":
            end = self.s.index("}", self.i)
            lo = int(self.s[self.i + 1:end].split(",")[0])
            self.i = end + 1
            return Expr("rep", (e,), size=lo)
        return e

    def expect(self, c: str) -> None:
        if self.peek() != c:
            raise ValueError(f"expected {c!r} at {self.i}")
        self.i += 1

    def closing(self, open_: str, close: str) -> int:
        j = self.i + 1
        while j < len(self.s) and self.s[j] != close:
            j += 2 if self.s[j] == "\\" else 1
        if j >= len(self.s):
            raise ValueError(f"unclosed {open_!r}")
        return j

    def balanced(self, j: int) -> int:
        depth = 0
        while j < len(self.s):
            c = self.s[j]
            if c == "\"":
                self.i = j
                j = self.closing("\"", "\"")
            elif c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if not depth:
                    return j + 1
            j += 1
        raise ValueError("unbalanced parentheses")


def read_rules(ebnf: str) -> dict[str, Expr]:
    """xgrammar's printed grammar (`name ::= body` a line) as {name: Expr}."""
    rules = {}
    for line in ebnf.splitlines():
        if "::=" not in line:
            continue
        name, _, body = line.partition("::=")
        reader = _Reader(body.strip())
        rules[name.strip()] = reader.alt()
        if reader.peek():
            raise ValueError(f"rule {name.strip()}: unread text at {reader.i}")
    return rules


def derivable(rules: dict[str, Expr]) -> tuple[set[str], set[str]]:
    """(the rules that derive some finite text, those that derive a non-empty one)."""
    some: set[str] = set()
    nonempty: set[str] = set()

    def can(e: Expr) -> tuple[bool, bool]:  # (some text, a non-empty text)
        if e.kind == "lit":
            return True, e.size > 0
        if e.kind == "any":
            return True, True
        if e.kind == "look":
            return True, False
        if e.kind == "ref":
            return e.name in some or e.name not in rules, e.name in nonempty or e.name not in rules
        got = [can(p) for p in e.parts]
        if e.kind == "seq":
            ok = all(g[0] for g in got)
            return ok, ok and any(g[1] for g in got)
        if e.kind == "alt":
            return any(g[0] for g in got), any(g[1] for g in got)
        inner_some, inner_nonempty = got[0]  # rep
        return (True, inner_nonempty) if e.size == 0 else (inner_some, inner_nonempty)

    changed = True
    while changed:
        changed = False
        for name, e in rules.items():
            s, n = can(e)
            if s and name not in some:
                some.add(name)
                changed = True
            if n and name not in nonempty:
                nonempty.add(name)
                changed = True
    return some, nonempty


def emptiness(ebnf: str, root: str = "root") -> str:
    """Why the grammar admits nothing useful ("" when it admits a non-empty text, or when this
    reader cannot tell)."""
    try:
        rules = read_rules(ebnf)
    except (ValueError, IndexError) as exc:
        log.debug("grammar not read (%s): taken as satisfiable", exc)
        return ""
    if root not in rules:
        return ""
    some, nonempty = derivable(rules)
    if root not in some:
        return ("no text satisfies it: its grammar never ends (a value that must contain itself, such as "
                "{\"$ref\": \"#\"} or a required property whose value is the whole schema again)")
    if root not in nonempty:
        return "only the empty text satisfies it, which is no JSON value (e.g. an anyOf or oneOf of nothing)"
    return ""


CIRCULAR = "Circular $ref chain"  # what newer grammar libraries say of a schema that only refers to itself


@functools.lru_cache(maxsize=CACHED_VERDICTS)
def check_schema(text: str) -> str:
    """`text` (JSON_OBJECT or a JSON schema's text) when a client may ask for it, else ValueError
    saying why: the grammar library refuses it, or its grammar admits no JSON value. Milliseconds
    for a typical schema: call it off the event loop."""
    try:
        check_grammar(text)
    except ValueError as exc:
        if CIRCULAR in str(exc):  # (xgrammar >= 0.2.9 finds a self-referring chain itself)
            raise ValueError(f"the JSON schema can never be satisfied: a $ref chain that never ends ({exc})") from exc
        raise
    if text == JSON_OBJECT:
        return text
    import xgrammar as xgr
    why = emptiness(str(xgr.Grammar.from_json_schema(text, any_whitespace=False)))
    if why:
        raise ValueError(f"the JSON schema can never be satisfied: {why}")
    return text
