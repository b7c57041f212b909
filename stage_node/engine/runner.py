"""The runner: every torch operation of a stage process, on one long-lived thread.

Two OpenMP thread teams (one per Python thread that ever runs torch) on the same cores slow each
other for good, so loading, profiling, the forward and sampling all go through `Runner.call`, and
the event loop never touches a tensor: it keeps receiving and sending while a step computes.

`execute` runs one planned step: the swap space's queued copies (engine.swap), copies (copy on
write), embedding or the received hidden states,
the forward over the paged KV, then sampling / candidate verification (last stage) or the hidden
states for the next stage. A sequence whose input is not finite fails alone; a forward that fails
for the batch is retried one sequence at a time, so one bad sequence never fails the others.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import torch

from logicpipe import tensor_codec
from logicpipe.errors import InvalidArgument, MeshError
from logicpipe.stage_node.engine.kv import KVPool, StepKV, seq_slice, step_kv
from logicpipe.stage_node.model.grammar import DeadEnd
from logicpipe.stage_node.model.sampling import penalize, sample, token_logprobs, verify
from logicpipe.stage_node.engine.scheduler import PlannedSeq, Step
from logicpipe.stage_node.model.shard import Shard
from logicpipe.stage_node.engine.step_graphs import GraphRow
from logicpipe.tensor_codec import RawTensor

log = logging.getLogger(__name__)

PROMPT_LOGITS_ROWS = 256  # prompt rows per pass over the LM head for prompt logprobs (each row: vocab floats)


class Runner:
    """A single worker thread that owns torch for the whole process."""

    def __init__(self, threads: int = 0):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-runner")
        self.thread_id: int | None = None
        self._pool.submit(self._init, threads).result()

    def _init(self, threads: int) -> None:
        self.thread_id = threading.get_ident()
        if threads:
            torch.set_num_threads(threads)  # the calling thread's OpenMP team: this one

    async def call(self, fn, *args, **kwargs):
        """Run fn(*args, **kwargs) on the runner thread; awaitable from the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class StepResult:
    hidden: RawTensor | None = None                          # later stage's input: rows of `ok`, in order
    ok: list[str] = field(default_factory=list)              # sequences computed, in step order
    tokens: dict[str, list[int]] = field(default_factory=dict)  # last stage: new tokens per sampled sequence
    logprobs: dict[str, list] = field(default_factory=dict)     # ... their TokenLogprobs (sessions that asked)
    prompt_logprobs: dict[str, dict] = field(default_factory=dict)  # ... position -> TokenLogprob of prompt rows
    failed: dict[str, MeshError] = field(default_factory=dict)


def execute(shard: Shard, pool: KVPool, step: Step, wire_dtype: str = "") -> StepResult:
    """Compute one step (on the runner thread); hidden states for the next stage leave in
    `wire_dtype` ("": the shard's dtype)."""
    with torch.inference_mode():
        lost = pool.swap.flush() if pool.swap is not None else set()  # (sessions whose KV did not come back)
        pool.copy_plans([p.plan for p in step.seqs])
        result = StepResult()
        rows = _input_rows(shard, step, result)  # sequence id -> its input rows
        for sid in lost & rows.keys():
            del rows[sid]
            result.failed[sid] = MeshError(f"session {sid}: the KV it swapped in was lost; replay it from its prompt")
        seqs = [p for p in step.seqs if p.seq.id in rows]
        if not seqs:
            return result
        try:
            outs = _forward(shard, pool, seqs, rows)
        except Exception as exc:  # noqa: BLE001 — find the sequence at fault; the others go on
            log.warning("a step of %d sequences failed (%s); retrying them one by one", len(seqs), exc)
            outs = {}
            for p in seqs:
                try:
                    outs.update(_forward(shard, pool, [p], rows))
                except Exception as one:  # noqa: BLE001
                    log.exception("session %s failed its step", p.seq.id)
                    result.failed[p.seq.id] = MeshError(f"step failed for session {p.seq.id}: {one}")
        seqs = [p for p in seqs if p.seq.id in outs]
        result.ok = [p.seq.id for p in seqs]
        if shard.last:
            _sample(shard, seqs, outs, result)
            _prompt_logprobs(shard, seqs, outs, result)
        elif seqs:
            hidden = torch.cat([outs[p.seq.id] for p in seqs])
            result.hidden = tensor_codec.from_tensor(hidden.to(getattr(torch, wire_dtype)) if wire_dtype else hidden)
        return result


@dataclass
class Launched:
    """A step of greedy rows (issue 32) whose device work is queued and whose tokens are not read
    back yet: `tokens` on the device (one per sampled sequence, in `sampled` order) feed the next
    step's embedding without a round trip; `host` (pinned) receives them, `ready` says when."""

    step: Step
    sampled: list[str]            # session ids of the sampled sequences, in the order of `tokens`
    tokens: torch.Tensor          # [len(sampled)] int64, on the device
    host: torch.Tensor            # their copy on the host (pinned on CUDA)
    ready: object = None          # a torch.cuda.Event recorded after the copy (None on a CPU)


def launch(shard: Shard, pool: KVPool, step: Step, source: tuple[torch.Tensor, list[int]] | None = None) -> Launched:
    """Queue one step of a one-stage pipeline (first and last) whose sampled rows are all plain
    greedy: copies, embedding, forward, LM head and argmax, and the tokens' copy to the host, with
    no wait for the device (on the runner thread). `source`: the previous launched step's device
    tokens and, for each of this step's sequences, the index of its input token among them (each
    such sequence has one row). The tokens are `sample`'s greedy choice: the argmax of the same
    logits (`Shard.greedy`). Raises where the forward fails (the caller fails the step's sequences)."""
    with torch.inference_mode():
        lost = pool.swap.flush() if pool.swap is not None else set()  # (sessions whose KV did not come back)
        if lost & {p.seq.id for p in step.seqs}:
            raise ValueError(f"sessions {sorted(lost)}: the KV they swapped in was lost; replay them")
        pool.copy_plans([p.plan for p in step.seqs])
        cuda = shard.device.type == "cuda"
        if source is None:
            ids = torch.tensor([t for p in step.seqs for t in p.work.token_ids], dtype=torch.long)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= shard.config.vocab_size):
                raise ValueError(f"token ids must lie in [0, {shard.config.vocab_size})")  # checked here, on the host
            hidden = shard.embed(ids.pin_memory().to(shard.device, non_blocking=True) if cuda else ids, checked=True)
        else:
            prev, index = source
            if index != list(range(len(index))) or len(index) != prev.shape[0]:
                at = torch.tensor(index, dtype=torch.long)
                prev = prev[at.pin_memory().to(shard.device, non_blocking=True) if cuda else at]
            hidden = shard.embed(prev, checked=True)
        rows, row = {}, 0
        for p in step.seqs:
            rows[p.seq.id] = hidden[row: row + p.work.num_tokens]
            row += p.work.num_tokens
        outs = _forward(shard, pool, step.seqs, rows)
        sampled = [p for p in step.seqs if p.work.sample]
        if not sampled:
            return Launched(step, [], torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
        tokens = shard.greedy(torch.cat([outs[p.seq.id][-1:] for p in sampled]))
        host = torch.empty(tokens.shape, dtype=torch.long, pin_memory=cuda)
        host.copy_(tokens, non_blocking=cuda)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record()
        return Launched(step, [p.seq.id for p in sampled], tokens, host, ready)


def read_tokens(launched: Launched) -> dict[str, list[int]]:
    """Wait for a launched step's tokens (on the runner thread) -> session id -> [its token]."""
    if launched.ready is not None:
        launched.ready.synchronize()
    return {sid: [t] for sid, t in zip(launched.sampled, launched.host.tolist())}


def _input_rows(shard: Shard, step: Step, result: StepResult) -> dict[str, torch.Tensor]:
    """Each sequence's input rows: embedded tokens (stage 0) or its rows of the received hidden
    states, which must be finite. rows: [num_tokens, hidden]"""
    if shard.first:
        ids = torch.tensor([t for p in step.seqs for t in p.work.token_ids], dtype=torch.long)  # to the device in embed
        hidden = shard.embed(ids)
        out, row = {}, 0
        for p in step.seqs:
            out[p.seq.id] = hidden[row: row + p.work.num_tokens]
            row += p.work.num_tokens
        return out
    parts = [tensor_codec.to_tensor(raw).to(shard.device, shard.dtype) for raw in step.parts]
    out = {}
    for p in step.seqs:
        x = parts[p.part][p.row: p.row + p.work.num_tokens]
        if not bool(torch.isfinite(x).all()):
            result.failed[p.seq.id] = InvalidArgument(
                f"session {p.seq.id}: its hidden states hold NaN or infinite values (the previous stage's "
                "arithmetic overflowed, or a client sent garbage)")
            continue
        out[p.seq.id] = x
    return out


def _forward(shard: Shard, pool: KVPool, seqs: list[PlannedSeq], rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The forward of `seqs` packed together -> each one's output rows: a CUDA graph's replay
    where the step fits one (see `stage_node.step_graphs`), else the eager forward. A replay's
    rows over kept layers (WritePlan.starts) resume from the rows the pool logged (issue 34). The
    output rows are logged where the pool keeps its end's."""
    if any(p.plan.starts for p in seqs):
        if pool.states is not None or shard.window is not None:  # (never planned: such a stage attaches no prefix, so resumes nothing)
            raise ValueError("a replay cannot resume over kept layers on a stage with linear-attention layers "
                             "or sliding windows")
        return _forward_resumed(shard, pool, seqs, rows)
    x = rows[seqs[0].seq.id] if len(seqs) == 1 else torch.cat([rows[p.seq.id] for p in seqs])
    out = None
    if shard.graphs is not None:
        window = pool.group is not None  # (the window layers' own pool: engine.window)
        out = shard.graphs.forward(x, [GraphRow(p.work.start_pos + j, p.plan.slots[j], p.read_blocks,
                                                p.plan.window.slots[j] if window else -1,
                                                p.window_blocks if window else None)
                                       for p in seqs for j in range(p.work.num_tokens)])
    slots = None
    if out is None:
        slots = torch.tensor([s for p in seqs for s in p.plan.slots], dtype=torch.long, device=shard.device)
        states = pool.states  # linear-attention layers: each sequence's state at its first row (engine.states)
        held = None if states is None else tuple(
            states.step(p.seq.id, p.work.start_pos, p.work.stop, p.work.num_candidates) for p in seqs)
        kv = step_kv(pool, shard.window, [(p.work.start_pos, p.work.num_tokens, p.read_blocks, p.window_blocks,
                                            decode_from(p)) for p in seqs], slots, shard.device, held,
                     [s for p in seqs for s in p.plan.window.slots] if pool.group is not None else None)
        out = shard.forward(x, kv)
        for p, st in zip(seqs, held or ()):  # the forward went through: the states it left are the sequences'
            states.commit(p.seq.id, st, p.work.start_pos)
    end = pool.logs.get(pool.span[1])
    if end is not None:
        if slots is None:  # a CUDA graph's step: its slots go up without waiting for the device
            slots = torch.tensor([s for p in seqs for s in p.plan.slots], dtype=torch.long)
            slots = slots.pin_memory().to(shard.device, non_blocking=True) if shard.device.type == "cuda" else slots
        end.index_copy_(0, slots, out.to(end.dtype))
    res, row = {}, 0
    for p in seqs:
        res[p.seq.id] = out[row: row + p.work.num_tokens]
        row += p.work.num_tokens
    return res


def _forward_resumed(shard: Shard, pool: KVPool, seqs: list[PlannedSeq],
                     rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A step holding replayed rows over kept layers: rows of a range grown downward first compute
    the layers under those they hold (WritePlan.pres; every such row of a step stops at the same
    layer); then each run of rows entering at the same layer is computed from there (its input: the rows logged at that boundary, or the step's own at the
    stage's first layer), highest entry first (so a row never reads a layer an earlier position
    has yet to write); rows that enter at the end are the logged output rows (on a last stage,
    where their output is not read, nothing)."""
    s, e = pool.span
    dev = shard.device
    runs: dict[int, list[tuple[PlannedSeq, int, int]]] = {}  # entry layer -> (seq, first row, stop row)
    for p in seqs:
        starts = p.plan.starts or (s,) * p.work.num_tokens
        a = 0
        for j in range(1, len(starts) + 1):
            if j == len(starts) or starts[j] != starts[a]:
                runs.setdefault(starts[a], []).append((p, a, j))
                a = j
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {p.seq.id: [] for p in seqs}
    end = pool.logs.get(e)
    # a range grown downward: its leading rows first compute the layers under those their blocks hold
    # (from the step's own input); their output there is not needed (they resume from a logged row)
    below = [(p, a, b, p.plan.pres[a]) for p in seqs if p.plan.pres
             for a, b in [(0, sum(1 for x in p.plan.pres if x > s))] if b]
    if below:
        slots = torch.tensor([x for p, a, b, _ in below for x in p.plan.slots[a:b]], dtype=torch.long, device=dev)
        kv = StepKV(pool, slots, tuple(seq_slice(p.work.start_pos + a, b - a, p.read_blocks, pool.block_size, dev,
                                                 decode_from(p)) for p, a, b, _ in below))
        shard.forward(torch.cat([rows[p.seq.id][a:b] for p, a, b, _ in below]), kv, stop=below[0][3] - s)
    for layer in sorted(runs, reverse=True):
        run = runs[layer]
        slots = torch.tensor([x for p, a, b in run for x in p.plan.slots[a:b]], dtype=torch.long, device=dev)
        if layer == e:
            out = end.index_select(0, slots) if end is not None else \
                torch.zeros(slots.numel(), shard.config.hidden_size, dtype=shard.dtype, device=dev)
        else:
            if layer == s:
                x = torch.cat([rows[p.seq.id][a:b] for p, a, b in run])
            else:
                x = pool.logs[layer].index_select(0, slots)
            kv = StepKV(pool, slots, tuple(seq_slice(p.work.start_pos + a, b - a, p.read_blocks, pool.block_size, dev,
                                                     decode_from(p)) for p, a, b in run))
            out = shard.forward(x, kv, first=layer - s)
            if end is not None:
                end.index_copy_(0, slots, out.to(end.dtype))
        row = 0
        for p, a, b in run:
            pieces[p.seq.id].append((a, out[row: row + b - a]))
            row += b - a
    return {sid: torch.cat([t for _, t in sorted(parts, key=lambda x: x[0])]) for sid, parts in pieces.items()}


def decode_from(p: PlannedSeq) -> int:
    """The first position of `p`'s sequence whose row is a decode row: after its prompt (a replay's
    generated tokens are decode rows again, computed as they were the first time). A session
    opened without its prompt: a step of more than one token (and its candidates) is prompt."""
    spec, w = p.seq.spec, p.work
    if spec.prompt:
        return len(spec.prompt) - spec.generated
    return w.stop if w.num_tokens - w.num_candidates > 1 else w.start_pos


def _sample(shard: Shard, seqs: list[PlannedSeq], outs: dict[str, torch.Tensor], result: StepResult) -> None:
    """Last stage: a token per sampled sequence, or its accepted candidates and the next token.
    The logits of every sampled row (a sequence's last row, or its row before each candidate and
    its last) come from one pass over the LM head."""
    sampled = [p for p in seqs if p.work.sample]
    if not sampled:
        return
    raw = shard.logits(torch.cat([outs[p.seq.id][-p.work.num_candidates - 1:] for p in sampled]))
    plain = [i for i, p in enumerate(sampled) if not p.work.num_candidates]
    rows, row = [], 0
    for p in sampled:
        rows.append(row)
        row += p.work.num_candidates + 1
    logits = raw  # what the choice is made from: with each penalized sequence's penalties and bias
    for p, r in zip(sampled, rows):
        if p.seq.spec.sampling.penalized:
            k = p.work.num_candidates
            logits = raw.clone() if logits is raw else logits
            logits[r: r + k + 1] = penalize(raw[r: r + k + 1], p.seq.spec.sampling, p.seq.generated_counts(),
                                            p.work.token_ids[len(p.work.token_ids) - k:] if k else ())
    allowed = {}  # constrained sequences: how many leading candidates their grammar allows
    for p, r in zip(sampled, rows):
        if p.seq.grammar is not None:  # masked after penalties and bias: the choice is always grammatical
            k = p.work.num_candidates
            logits = raw.float().clone() if logits is raw else logits
            try:
                allowed[p.seq.id] = p.seq.grammar.mask_rows(logits[r: r + k + 1], p.seq.generated,
                                                            p.work.token_ids[len(p.work.token_ids) - k:] if k else ())
            except DeadEnd as exc:  # the request's own error (INVALID_ARGUMENT): it ends, never replayed
                result.failed[p.seq.id] = exc
    plain = [i for i in plain if sampled[i].seq.id not in result.failed]  # (a dead end's row allows nothing)
    if plain:
        ps = [sampled[i] for i in plain]
        tokens = sample(logits[[rows[i] for i in plain]], [p.seq.spec.sampling for p in ps],
                        [p.draws[0] if p.draws else None for p in ps])
        for p, t in zip(ps, tokens):
            result.tokens[p.seq.id] = [t]
    for p, r in zip(sampled, rows):
        if p.seq.id in result.failed:
            continue
        k = p.work.num_candidates
        if k:  # [k + 1, vocab]: the row before each candidate, and the last
            j = allowed.get(p.seq.id, k)  # candidates from the first the grammar rejects on are cut
            result.tokens[p.seq.id] = verify(logits[r: r + j + 1], p.work.token_ids[len(p.work.token_ids) - k:][:j],
                                             p.seq.spec.sampling, (p.draws or (None,) * (k + 1))[:j + 1])
        if p.seq.grammar is not None and not p.seq.grammar.advance(p.seq.generated, result.tokens[p.seq.id]):
            del result.tokens[p.seq.id]  # (cannot happen: every choice was masked; said, not hidden)
            result.failed[p.seq.id] = MeshError(f"session {p.seq.id}: a token chosen under its grammar's mask "
                                                "was rejected by the grammar")
            continue
        top = p.seq.spec.top_logprobs
        if top is not None:  # token j was chosen in row r + j (an accepted candidate's verification row)
            tokens = result.tokens[p.seq.id]
            result.logprobs[p.seq.id] = token_logprobs(raw[r: r + len(tokens)], tokens, top)  # the model's own


def _prompt_logprobs(shard: Shard, seqs: list[PlannedSeq], outs: dict[str, torch.Tensor], result: StepResult) -> None:
    """Last stage, sessions that asked for prompt logprobs: the logprob of each prompt token at
    position i + 1 from the logits of row i of this step (the prompt's last row samples the first
    new token: not one of them); the LM head runs over PROMPT_LOGITS_ROWS rows at a time."""
    for p in seqs:
        spec, w = p.seq.spec, p.work
        if spec.prompt_logprobs is None:
            continue
        prompt = spec.prompt[:len(spec.prompt) - spec.generated]  # a replay's holds its generated tokens too
        m = min(w.stop, len(prompt) - 1) - w.start_pos  # rows whose next token is a prompt token
        got = {}
        for a in range(0, max(0, m), PROMPT_LOGITS_ROWS):
            rows = outs[p.seq.id][a: min(m, a + PROMPT_LOGITS_ROWS)]
            first = w.start_pos + 1 + a  # the position of the token row a predicts
            lps = token_logprobs(shard.logits(rows), prompt[first: first + rows.shape[0]], spec.prompt_logprobs)
            got.update(zip(range(first, first + len(lps)), lps))
        if got:
            result.prompt_logprobs[p.seq.id] = got
