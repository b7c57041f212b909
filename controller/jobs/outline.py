"""Outline-DAG requests: the model writes an outline of points with dependencies, then every ready
point decodes as its own sequence, all of them in the same steps (and beside other requests).

Token layout, and why it is exact. A point's sequence is the outline prefix (question, outline),
then the segments (header + generated text) of its ancestors in outline order, each once, then
its own header. Positions therefore never move: no key is re-rotated. The KV of the longest
earlier sequence that is a prefix of it is shared (a stage-local fork: the outline's, or its last
predecessor's); the rest is computed as a prompt chunk. A point with one predecessor continues
from that predecessor's full KV; a point with several shares the KV of the one its layout extends
and computes the other predecessors' segments again (the prefix cache attaches whatever full
blocks of them it holds). Either way a point's tokens are exactly those of its sequence decoded
from scratch, up to the kernel rounding of prompt rows vs decode rows (see README "Exactness").

The parser takes lines `N. Content. [deps]` (brackets optional), repairs what it can and never
gives up: unparsable lines are skipped, an unknown dependency or one on a later point (the only
way a cycle can form) is dropped, every repair is reported; nothing parsable falls back to one
point (the question itself).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from logicpipe.controller.jobs.job import OUTLINE_RECORD, Job, sampling_from_json, sampling_to_json
from logicpipe.controller.jobs.scheduler import RequestHandle, Scheduler
from logicpipe.errors import InvalidArgument
from logicpipe.sampling import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_POINTS = 8
MAX_POINTS = 32           # points of one outline request
OUTLINE_TOKENS_PER_POINT = 24  # the outline the model writes: 16 + this per point allowed, tokens
MAX_TITLE_CHARS = 200
ASK = "\x00ASK\x00"       # where a point's request goes in the rendered turn
LINE = re.compile(r"^\s*(\d{1,3})\s*[.)]\s*(.*?)\s*(?:\[([^\]]*)\])?\s*$")
EXAMPLE = ("Question: How do I make tea?\n"
           "1. Boil water. []\n2. Warm the pot. [1]\n3. Add the leaves. [2]\n4. Pour and steep. [1, 3]\n")


@dataclass
class Point:
    id: int                      # 1-based, outline order
    title: str
    deps: tuple[int, ...]        # earlier points it builds on
    ids: list[int] = field(default_factory=list)      # its sequence's input (prefix, segments, header)
    tokens: list[int] = field(default_factory=list)   # what it generated
    text: str = ""
    shared: str = ""             # whose KV it forked: "outline", "point N", "none (recomputed)"
    start: float = 0.0
    end: float = 0.0
    request: RequestHandle | None = None  # its request (its sequence kept open while later points may fork it)
    line_end: int = 0            # offset in the outline text just past its line


def parse_outline(text: str, max_points: int = DEFAULT_POINTS) -> tuple[list[Point], list[str]]:
    """Points and the repairs made (one line each)."""
    warnings: list[str] = []
    points: list[Point] = []
    number_to_id: dict[int, int] = {}
    offset = 0
    for line in text.splitlines(keepends=True):
        offset += len(line)
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        m = LINE.match(line)
        if m is None or not m.group(2).strip(" .-"):
            if points:  # the outline is over (small models go on with another example)
                warnings.append(f"ignored what follows the outline: {line.strip()[:80]!r}")
                break
            warnings.append(f"skipped a line that is not a point: {line.strip()[:80]!r}")
            continue
        if len(points) >= max_points:
            warnings.append(f"kept the first {max_points} points; dropped the rest")
            break
        number, title, deps_text = int(m.group(1)), m.group(2).strip()[:MAX_TITLE_CHARS], m.group(3) or ""
        pid = len(points) + 1
        deps: list[int] = []
        for tok in re.findall(r"\d+", deps_text):
            d = int(tok)
            if d not in number_to_id:
                why = "itself or a later point (a cycle could form)" if d >= number else "no such point"
                warnings.append(f"point {pid}: dropped dependency on {d}: {why}")
                continue
            if number_to_id[d] not in deps:
                deps.append(number_to_id[d])
        if number in number_to_id:
            warnings.append(f"point {pid}: number {number} used twice; dependencies on it mean the first")
        else:
            number_to_id[number] = pid
        points.append(Point(pid, title, tuple(sorted(deps)), line_end=offset))
    if not points:
        warnings.append("nothing in the outline parsed: one point, the whole answer")
    return points, warnings


def ancestors(points: list[Point], p: Point) -> list[int]:
    """Ids of every point `p` depends on, directly or not, in outline order."""
    seen: set[int] = set()
    todo = list(p.deps)
    while todo:
        d = todo.pop()
        if d not in seen:
            seen.add(d)
            todo.extend(points[d - 1].deps)
    return sorted(seen)


def outline_record(question: str, *, outline_text: str, max_points: int, point_tokens: int,
                   sampling: SamplingParams, sequential: bool, speculate: int | None, client: str,
                   prompt_tokens: int) -> dict:
    """An outline request as the journal keeps it: what runs it again, exactly (greedy, or with
    this seed), for the client that resumes it after the controller died."""
    return {OUTLINE_RECORD: {"question": question, "outline_text": outline_text, "max_points": max_points,
                             "point_tokens": point_tokens, "sampling": sampling_to_json(sampling),
                             "sequential": sequential, "speculate": speculate, "client": client,
                             "prompt_tokens": prompt_tokens}}


def run_of_record(scheduler: Scheduler, tokenizer, doc: dict) -> "OutlineRun":
    """The run `outline_record` describes (from its start)."""
    r = doc[OUTLINE_RECORD]
    return OutlineRun(scheduler, tokenizer, str(r["question"]), outline_text=str(r["outline_text"]),
                      max_points=int(r["max_points"]), point_tokens=int(r["point_tokens"]),
                      sampling=sampling_from_json(r["sampling"]), sequential=bool(r["sequential"]),
                      speculate=None if r["speculate"] is None else int(r["speculate"]))


class OutlineRun:
    """One outline request: the outline, then its points, decoded as they become ready."""

    def __init__(self, scheduler: Scheduler, tokenizer, question: str, *, outline_text: str = "", max_points: int = 0,
                 point_tokens: int = 96, sampling: SamplingParams = SamplingParams(), sequential: bool = False,
                 speculate: int | None = None):
        if max_points > MAX_POINTS:
            raise InvalidArgument(f"max_points {max_points} is over the cap of {MAX_POINTS}")
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.question = question
        self.outline_text = outline_text
        self.max_points = max_points or DEFAULT_POINTS
        self.point_tokens = point_tokens
        self.sampling = sampling
        self.speculate = speculate  # candidates per step of every sequence (None: the controller's default)
        self.sequential = sequential
        self.points: list[Point] = []
        self.warnings: list[str] = []
        self.submitted = time.monotonic()
        self.outline_tokens: list[int] = []
        self._kept: list[RequestHandle] = []  # every request of the run (released at its end)
        # a blank line ends the outline and each point
        self.stop_ids = frozenset(t for t in (self._single_token("\n\n"),) if t is not None)

    def _single_token(self, text: str) -> int | None:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[0] if len(ids) == 1 else None

    def _tokens_covering(self, tokens: list[int], chars: int) -> int:
        """The fewest leading tokens whose text is at least `chars` long (all when none is)."""
        for k in range(1, len(tokens) + 1):
            if len(self.tokenizer.decode(tokens[:k], skip_special_tokens=True)) >= chars:
                return k
        return len(tokens)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prefix_ids(self) -> list[int]:
        """The chat turn that asks for the outline, the assistant's turn begun with "1." (small
        models follow the format only when it is started for them)."""
        ask = (f"{EXAMPLE}\nWrite a short outline of the answer to the question below as numbered points, one "
               "per line, in the form `N. Brief content. [deps]`, where deps lists the numbers of earlier points "
               f"it builds on. At most {self.max_points} points.\nQuestion: {self.question}")
        tok = self.tokenizer
        if tok.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                           add_generation_prompt=True)
        else:
            text = ask + "\n"
        return self.encode(text) + self.encode("1.")

    def header_ids(self, p: Point) -> list[int]:
        """What asks for point p: a new user turn after the outline (or the point before), in the
        model's chat format when it has one."""
        return self.encode(self._turn.replace(ASK, f"Write two or three sentences of plain prose, no list, about: "
                                                   f"{p.title}"))

    @functools.cached_property
    def _turn(self) -> str:
        """The text that ends the assistant's turn, asks ASK and opens the next assistant turn, in
        the model's chat format (rendered once per request)."""
        tok = self.tokenizer
        if not tok.chat_template:
            return f"\n\n{ASK}\n"
        mark = "\x00OUTLINE\x00"
        system = {"role": "system", "content": "You are a helpful assistant."}
        full = tok.apply_chat_template([system, {"role": "user", "content": "q"},
                                        {"role": "assistant", "content": mark}, {"role": "user", "content": ASK}],
                                       tokenize=False, add_generation_prompt=True)
        at = full.find(mark)
        return full[at + len(mark):] if at >= 0 else f"\n\n{ASK}\n"

    # ---- running -----------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[tuple[int, int, bool]]:
        """(point id, token, finished) as tokens come: point 0 is the outline. Every sequence kept
        open for forks is closed at the end, however it ends."""
        try:
            async for ev in self._run():
                yield ev
        finally:
            for handle in self._kept:
                handle.release()

    def _submit(self, job: Job) -> RequestHandle:
        handle = self.scheduler.submit(job)
        self._kept.append(handle)
        return handle

    async def _run(self) -> AsyncIterator[tuple[int, int, bool]]:
        prefix = self.prefix_ids()
        if self.outline_text:  # given: the prefix is computed once (one token sampled, unused)
            prefix = prefix[:-len(self.encode("1."))] + self.encode(self.outline_text.strip())
            outline = self._submit(Job(tuple(prefix), 1, self.sampling, keep_open=True, speculate=self.speculate))
            async for _ in outline:
                pass
            text = self.outline_text
            outline_ids, outline_len = prefix, len(prefix)
        else:
            budget = 16 + OUTLINE_TOKENS_PER_POINT * self.max_points
            outline = self._submit(Job(tuple(prefix), budget, SamplingParams(), stop_ids=self.stop_ids, keep_open=True,
                                       speculate=self.speculate))
            async for u in outline:
                self.outline_tokens.append(u.token_id)
                yield 0, u.token_id, u.finished
            text = "1." + self.tokenizer.decode(self.outline_tokens, skip_special_tokens=True)
        self.points, self.warnings = parse_outline(text, self.max_points)
        if not self.outline_text:  # the points see the outline only, not what the model wrote after it
            k = self._tokens_covering(self.outline_tokens, self.points[-1].line_end - len("1.") if self.points else 0)
            outline_ids = prefix + self.outline_tokens[:k]
            outline_len = len(prefix) + min(k, len(self.outline_tokens) - 1)  # the last was sampled, not computed
        for w in self.warnings:
            log.info("outline: %s", w)
        if not self.points:
            self.points = [Point(1, self.question[:MAX_TITLE_CHARS], ())]
        queue: asyncio.Queue = asyncio.Queue()
        pending = {p.id for p in self.points}
        running: dict[int, asyncio.Task] = {}
        done: set[int] = set()
        try:
            while pending or running:
                ready = [pid for pid in sorted(pending) if set(self.points[pid - 1].deps) <= done]
                if self.sequential:
                    ready = ready[:1] if not running else []
                for pid in ready:
                    pending.discard(pid)
                    p = self.points[pid - 1]
                    running[pid] = asyncio.create_task(self._point(p, outline_ids, outline_len, outline, queue))
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                pid, token, finished = item
                yield pid, token, finished
                if finished:
                    await running.pop(pid)
                    done.add(pid)
        finally:
            for task in running.values():
                task.cancel()

    async def _point(self, p: Point, outline_ids: list[int], outline_len: int, outline: RequestHandle,
                     queue: asyncio.Queue) -> None:
        try:
            segments = ancestors(self.points, p)
            ids = list(outline_ids)
            for a in segments:
                ids += self.header_ids(self.points[a - 1]) + self.points[a - 1].tokens
            p.ids = ids + self.header_ids(p)
            # fork from the longest earlier sequence this one extends: a predecessor's (the last that
            # fits), else the outline's, which every point extends
            fork, p.shared = None, "none (recomputed)"
            for d in reversed(p.deps):
                base = self.points[d - 1]
                n = len(base.ids) + len(base.tokens)
                if p.ids[:n] == base.ids + base.tokens and base.request is not None and base.request.session_id:
                    fork, p.shared = (base.request.session_id, n - 1), f"point {base.id}"
                    break
            if fork is None and outline.session_id:
                fork, p.shared = (outline.session_id, outline_len), "outline"
            keep = any(p.id in q.deps for q in self.points)
            p.start = time.monotonic() - self.submitted
            handle = self._submit(Job(tuple(p.ids), self.point_tokens, self.sampling, stop_ids=self.stop_ids,
                                      parent=fork, keep_open=keep, speculate=self.speculate))
            async for u in handle:
                if u.token_id not in self.stop_ids:
                    p.tokens.append(u.token_id)
                queue.put_nowait((p.id, u.token_id, u.finished))
            p.request = handle
            p.end = time.monotonic() - self.submitted
            p.text = self.tokenizer.decode(p.tokens, skip_special_tokens=True).strip()
        except BaseException as exc:  # noqa: BLE001 — the run fails with it
            queue.put_nowait(exc)
            raise
