"""`GET /metrics` in Prometheus' format (prometheus_client): counters and gauges from the
controller's snapshot at scrape time (the same one Status and `lpctl status` read), per-stage
figures from a Status probe of each stage, and latency histograms: time to first token observed as
each request ends, and every gap between two consecutive tokens of a request as it is handed to
the client (the scheduler's gap_observers), so a stall of seconds in the middle of a long answer
shows in the tail instead of vanishing into that request's mean. Tokens that come in one pipeline
trip (accepted candidate tokens) reach the client together: gaps of ~0 s, as the client sees them.

Requests end as completed, failed (an error: a stage fault past its replays, no token in time) or
cancelled (no error: the client went away, a Ctrl-C or a closed connection)."""
from __future__ import annotations

import asyncio

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from logicpipe.controller.app import ControllerApp
from logicpipe.controller.jobs.door import handoff_timings
from logicpipe.controller.jobs.job import Request

STAGE_PROBE_TIMEOUT_S = 2.0


class Metrics:
    BUCKETS_TTFT = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
    # up to 30 s: under load a gap of several seconds is what needs seeing (a load generator saw P99s of 6-9 s)
    BUCKETS_ITL = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)

    def __init__(self, app: ControllerApp):
        self.app = app
        self.registry = CollectorRegistry()
        self.ttft = Histogram("logicpipe_time_to_first_token_seconds", "Submission to first token",
                              buckets=self.BUCKETS_TTFT, registry=self.registry)
        self.itl = Histogram("logicpipe_inter_token_latency_seconds",
                             "Time between two consecutive tokens of a request as handed to its client",
                             buckets=self.BUCKETS_ITL, registry=self.registry)
        self.handoff = Histogram("logicpipe_disaggregated_ttft_seconds",
                                 "A disaggregated request's time to first token by phase: prefill on the prefill "
                                 "pipeline, KV transfer, first decode step", ["phase"], buckets=self.BUCKETS_TTFT,
                                 registry=self.registry)
        self._stages: list = []  # (node id, stage StatusReply) of the last probe
        app.scheduler.observers.append(self._observe)
        app.scheduler.gap_observers.append(self.itl.observe)
        self.registry.register(self)

    def _observe(self, req: Request) -> None:
        if req.times.first_token:
            self.ttft.observe(req.times.first_token - req.times.submitted)
        split = handoff_timings(req)
        for phase in ("prefill", "transfer", "first_step") if split else ():
            self.handoff.labels(phase).observe(split[f"{phase}_s"])

    async def scrape(self) -> tuple[bytes, str]:
        """The exposition text and its content type, after probing the plan's stages (their KV
        blocks, step times)."""
        stages = list(self.app.pipelines.stages)
        probes = await asyncio.gather(*(self.app.pipelines.probe(h.address, timeout=STAGE_PROBE_TIMEOUT_S)
                                        for h in stages), return_exceptions=True)
        self._stages = [(h.node_id or h.address, p) for h, p in zip(stages, probes) if not isinstance(p, BaseException)]
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def describe(self):
        return []

    def collect(self):
        snap = self.app.snapshot()
        st = snap.stats
        requests = CounterMetricFamily("logicpipe_requests", "Requests by outcome", labels=["outcome"])
        requests.add_metric(["completed"], st.completed)
        requests.add_metric(["failed"], st.failed)
        requests.add_metric(["cancelled"], st.cancelled)
        yield requests
        tokens = CounterMetricFamily("logicpipe_tokens", "Tokens in (prompts) and out (generated)", labels=["direction"])
        tokens.add_metric(["in"], st.prompt_tokens)
        tokens.add_metric(["out"], st.generated_tokens)
        yield tokens
        yield GaugeMetricFamily("logicpipe_active_sequences", "Requests running on the stages", value=snap.running)
        yield GaugeMetricFamily("logicpipe_queued_sequences", "Requests waiting for the mesh", value=snap.queued)
        yield CounterMetricFamily("logicpipe_replans", "Plans installed", value=snap.replans)
        yield CounterMetricFamily("logicpipe_replays", "Requests moved to another pipeline and replayed",
                                  value=st.replays)
        replayed = CounterMetricFamily("logicpipe_replay_tokens", "Input positions of replays: computed again, or "
                                       "held by the stages already (prefix caches, KV mirrors)", labels=["how"])
        replayed.add_metric(["computed"], st.replay_tokens - st.replay_cached_tokens)
        replayed.add_metric(["cached"], st.replay_cached_tokens)
        yield replayed
        yield CounterMetricFamily("logicpipe_evacuated", "Requests moved off a pipeline whose stage went silent "
                                  "(replayed on another)", value=st.evacuated)
        yield CounterMetricFamily("logicpipe_preemptions", "Requests preempted for KV blocks", value=st.preemptions)
        rate = st.candidates_accepted / st.candidates if st.candidates else 0.0
        yield GaugeMetricFamily("logicpipe_candidate_acceptance_ratio", "Candidate tokens accepted / verified",
                                value=rate)
        blocks = GaugeMetricFamily("logicpipe_stage_kv_blocks_used", "KV blocks in use per stage", labels=["node"])
        step = GaugeMetricFamily("logicpipe_stage_step_seconds", "Mean compute time per step per stage",
                                 labels=["node"])
        for node, s in self._stages:
            blocks.add_metric([node], s.kv_blocks_used)
            step.add_metric([node], s.compute_s / s.steps if s.steps else 0.0)
        yield blocks
        yield step
        running = GaugeMetricFamily("logicpipe_pipeline_running", "Requests running per pipeline (replica)",
                                    labels=["pipeline"])
        predicted = GaugeMetricFamily("logicpipe_pipeline_predicted_tokens_per_second",
                                      "Decode tokens/s the planner predicts per pipeline at the learned workload",
                                      labels=["pipeline"])
        serving = GaugeMetricFamily("logicpipe_pipeline_serving", "1 while a pipeline takes requests", labels=["pipeline"])
        stages = GaugeMetricFamily("logicpipe_pipeline_stages", "Stages per pipeline", labels=["pipeline"])
        silent = GaugeMetricFamily("logicpipe_pipeline_silent", "1 while a stage of a pipeline does not answer (while "
                                   "another replica answers, its requests move there)", labels=["pipeline"])
        for p in snap.pipelines:
            silent.add_metric([str(p.index)], 1.0 if p.silent else 0.0)
            running.add_metric([str(p.index)], p.running)
            predicted.add_metric([str(p.index)], p.predicted_tokens_per_s)
            serving.add_metric([str(p.index)], 1.0 if p.serving else 0.0)
            stages.add_metric([str(p.index)], sum(1 for s in snap.stages if s.pipeline == p.index))
        yield running
        yield predicted
        yield serving
        yield stages
        yield silent
        hop = GaugeMetricFamily("logicpipe_link_latency_seconds", "Measured one-way latency between nodes",
                                labels=["src", "dst"])
        for src, links in snap.links.items():
            for dst, link in links.items():
                hop.add_metric([src, dst], link.latency)
        yield hop
