"""The last stage's share of a step's postprocessing, as plain functions: the tokens it reports
(cut at a stop token or the length limit), the feed back to stage 0 of each sequence that goes
on, and the candidates that ride with it (stage_node.drafter: how many, and prompt lookup's; the
draft model's are filled in by `with_drafts` once it has run).

The sequences sampled in one step go back together and share stage 0's next step: their
candidates are handed out for that step as a whole (`drafter.allocate`).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from logicpipe.stage_node.engine.blocks import KVManager
from logicpipe.stage_node.engine.drafter import STEP_COST, Drafter, StepCost, allocate
from logicpipe.stage_node.net.events import TokenEvent
from logicpipe.stage_node.engine.scheduler import PlannedSeq, Scheduler
from logicpipe.stage_node.engine.sequence import SeqStatus, Sequence, SeqWork

PREFILLED = "prefilled"  # the finish reason of a prefill_only sequence whose prompt's KV is held


@dataclass(frozen=True)
class DraftJob:
    """Candidates the draft model is to propose for one feed."""

    feed: int            # index of the feed they ride with
    session_id: str
    context: list[int]   # the sequence's tokens so far
    k: int               # candidates at most


@dataclass
class Outcome:
    """What a step's sampled sequences produced."""

    events: dict[str, list[TokenEvent]] = field(default_factory=lambda: defaultdict(list))  # owner -> its events
    feeds: list[SeqWork] = field(default_factory=list)  # to stage 0: each sequence that goes on, its last token
    jobs: list[DraftJob] = field(default_factory=list)  # the draft model's share of the candidates
    sampled: int = 0     # sequences that reported tokens
    tokens: int = 0      # the tokens they reported
    verified: int = 0    # candidates verified
    accepted: int = 0    # ... and accepted (as the owner counts them: up to a stop)


def take_tokens(scheduler: Scheduler, kv: KVManager, done: list[PlannedSeq], tokens: dict[str, list[int]], *,
                orphaned: Callable[[Sequence], bool], draft_model: bool, logprobs: dict | None = None,
                prompt_logprobs: dict | None = None, cost: StepCost = STEP_COST) -> Outcome:
    """The tokens of every sampled sequence of a step (`tokens`: what the runner sampled or
    verified, per sequence; `logprobs`: their TokenLogprobs, of the sequences that asked), the
    feeds for stage 0 and their candidates; `prompt_logprobs`: position -> TokenLogprob of the
    prompt rows computed, kept on the sequence until its first event carries them. `orphaned`: sequences whose owner is gone get no feed;
    `draft_model`: candidates come from it (as jobs), else from prompt lookup (in the feeds);
    `cost`: what a step of this stage costs by its rows (how many candidates pay)."""
    logprobs = logprobs or {}
    prompt_logprobs = prompt_logprobs or {}
    out = Outcome()
    offers: list[tuple[int, Sequence, int, list[int] | None]] = []  # (feed, seq, how many, lookup's proposal)
    for p in done:
        if p.seq.id in prompt_logprobs:
            p.seq.prompt_lps = {**(p.seq.prompt_lps or {}), **prompt_logprobs[p.seq.id]}
        if p.seq.spec.prefill_only:  # disaggregated prefill: its KV is all the owner wants
            if p.work.stop >= len(p.seq.spec.prompt):
                p.seq.status = SeqStatus.FINISHED
                out.events[p.seq.spec.owner].append(TokenEvent(p.seq.id, (), 0, PREFILLED))
            continue
        if not p.work.sample or p.seq.id not in tokens:
            continue
        index = p.seq.generated
        sampled = tokens[p.seq.id]
        reported, reason = scheduler.finish(p, sampled)
        k = p.work.num_candidates
        out.sampled += 1
        out.tokens += len(reported)
        out.verified += k
        out.accepted += len(reported) - 1 if k else 0
        lps = tuple(logprobs.get(p.seq.id, ())[:len(reported)])  # (cut with the tokens at a stop)
        prompt_lps = ()
        if p.seq.prompt_lps is not None:  # the first event: every prompt token's, in order
            prompt_lps, p.seq.prompt_lps = tuple(lp for _, lp in sorted(p.seq.prompt_lps.items())), None
        out.events[p.seq.spec.owner].append(TokenEvent(p.seq.id, tuple(reported), index, reason, k, lps, prompt_lps))
        if orphaned(p.seq):
            continue
        pos = p.work.stop - k + len(reported) - 1  # where its last token goes
        if not reason and p.seq.spec.speculate:  # nothing cut: `reported` is `sampled`
            offers.append((len(out.feeds), p.seq, *offer(kv, p, sampled, pos, draft_model)))
        out.feeds.append(SeqWork(p.seq.id, pos, (reported[-1],), finished=bool(reason)))  # finished: stage 0 stops
    counts = allocate([s.draft.acceptance for _, s, _, _ in offers], [n for _, _, n, _ in offers], cost)
    for (i, s, _, proposal), k in zip(offers, counts):
        if not k:
            continue
        if proposal is None:
            out.jobs.append(DraftJob(i, s.id, list(s.draft.context), k))
        else:
            w = out.feeds[i]
            out.feeds[i] = SeqWork(w.session_id, w.start_pos, (*w.token_ids, *proposal[:k]), num_candidates=k)
    return out


def offer(kv: KVManager, p: PlannedSeq, sampled: list[int], pos: int, draft_model: bool) -> tuple[int, list[int] | None]:
    """A speculating sequence that goes on: record how its candidates fared, and offer candidates
    for the positions after `sampled` (the step's accepted candidates and its sampled token, whose
    last goes at `pos`) -> (how many it may send, prompt lookup's proposal; None: the draft model
    drafts them)."""
    s = p.seq
    k = p.work.num_candidates
    if s.draft is None:  # its context: what the KV holds before this step's candidates, then `sampled`
        s.draft = Drafter(kv.tables[s.id].tokens[:p.work.stop - k], s.spec.speculate)
    s.draft.observe(k, len(sampled) - 1, sampled)
    limit = min(s.spec.max_new_tokens - s.generated - 1, s.spec.capacity - pos - 1)
    n = s.draft.budget(limit) if limit > 0 else 0
    if draft_model:
        return n, None
    proposal = s.draft.lookup.propose(n)
    return len(proposal), proposal


def with_drafts(feeds: list[SeqWork], jobs: list[DraftJob], drafts: list[list[int]]) -> list[SeqWork]:
    """The feeds with the draft model's candidates (`drafts`, one list per job) added."""
    feeds = list(feeds)
    for job, d in zip(jobs, drafts):
        w = feeds[job.feed]
        feeds[job.feed] = SeqWork(w.session_id, w.start_pos, (*w.token_ids, *d), num_candidates=len(d))
    return feeds
