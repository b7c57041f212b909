"""The controller's gRPC adapter: translates between protobuf and the controller's domain types. A
request goes through the front door (controller.requests) exactly as one from the HTTP API does."""
from __future__ import annotations

import asyncio
import time

from logicpipe.common.security.bundle import TlsError, check_name
from logicpipe.common.transport import Transport, caller_address
from logicpipe.controller.app import ControllerApp, ControllerSnapshot, StageView
from logicpipe.controller.mesh.join import JoinAuthority
from logicpipe.controller.mesh.membership import FORGET_AFTER_S, NOT_PROBED
from logicpipe.controller.jobs.door import Completion, FrontDoor, Timings, host_client
from logicpipe.controller.jobs.rules import OutlineOptions, Prompt, RequestOptions
from logicpipe.controller.jobs.scheduler import DEFAULT_MAX_TOKENS
from logicpipe.controller.jobs.standby import Replicator
from logicpipe.controller.mesh.state import Phase
from logicpipe.controller.mesh.weights_server import stream_weights
from logicpipe.errors import FailedPrecondition, InvalidArgument, MeshError, PermissionDenied, ResourceExhausted
from logicpipe.limits import check_address, check_id
from logicpipe.policy import STAGE, STREAM_KEY_HEADER
from logicpipe.sampling import SamplingParams
from logicpipe.v1 import controller_pb2, controller_pb2_grpc

DEFAULT_LEAVE_S = 20.0  # a stopping node's Leave waits this long for its requests to move (unless it says)
MAX_LEAVE_S = 120.0
STATUS_PROBE_TIMEOUT_S = 1.0  # a node that does not answer Status this fast shows as unreachable (Status answers in 2 s)
DEFAULT_POINT_TOKENS = 96  # outline requests: new tokens per point unless max_tokens says
# Register is open to anyone who reaches the port in plaintext, and each new address is a member
# probed every 2 s for 10 minutes: a token bucket per caller (a stage registers every 5 s: 25
# stages behind one host stay under it), and a cap on registered members that do not answer.
REGISTER_BURST = 30          # Register calls one caller may make at once ...
REGISTER_PER_S = 5.0         # ... and a second, on average
MAX_SILENT_REGISTERED = 64   # members learnt by Register that have not answered a probe
MAX_RATE_CALLERS = 4096      # callers whose bucket is kept (full buckets are dropped first)


def client_identity(transport: Transport, context) -> str:
    """Who a call comes from: its certificate's name over TLS, else the peer's host."""
    role, name = transport.peer(context)
    if role:
        return f"{role}:{name}"
    kind, _, rest = context.peer().partition(":")  # "ipv4:1.2.3.4:5678", "ipv6:[::1]:5678"
    return host_client(rest.rpartition(":")[0]) if kind in ("ipv4", "ipv6") else context.peer()


class RateCap:
    """A token bucket per caller: `burst` calls at once, `per_s` a second on average."""

    def __init__(self, burst: int, per_s: float):
        self.burst, self.per_s = burst, per_s
        self._buckets: dict[str, tuple[float, float]] = {}  # caller -> (tokens, when counted)

    def take(self, caller: str) -> bool:
        """Whether `caller` may make one more call now (it is counted if so)."""
        now = time.monotonic()
        tokens, at = self._buckets.get(caller, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.per_s)
        ok = tokens >= 1
        self._buckets[caller] = (tokens - ok, now)
        if len(self._buckets) > MAX_RATE_CALLERS:  # forget the callers that are full again, else the oldest
            full = [c for c, (t, a) in self._buckets.items() if t + (now - a) * self.per_s >= self.burst]
            for c in full or sorted(self._buckets, key=lambda c: self._buckets[c][1])[:len(self._buckets) // 2]:
                del self._buckets[c]
        return ok


def submit_request(request: controller_pb2.SubmitRequest) -> tuple[Prompt, RequestOptions]:
    """A Submit request as the front door's types."""
    prompt = Prompt(text=request.prompt, raw=request.raw, messages=tuple((m.role, m.content) for m in request.messages),
                    token_ids=tuple(request.prompt_token_ids))
    outline = None
    if request.outline:
        outline = OutlineOptions(max_points=request.max_points, outline_text=request.outline_text,
                                 sequential=request.sequential_points)
    else:  # an outline's fields without `outline` would be dropped: refused instead
        given = [name for name in ("max_points", "outline_text", "sequential_points") if getattr(request, name)]
        if given:
            raise InvalidArgument(f"{', '.join(given)}: for an outline request only; set outline too")
    options = RequestOptions(
        max_tokens=request.max_tokens or (DEFAULT_POINT_TOKENS if outline else DEFAULT_MAX_TOKENS),
        sampling=SamplingParams.from_proto(request.sampling), ignore_eos=request.ignore_eos,
        speculate=request.speculate if request.HasField("speculate") else None, prefill_chunk=request.prefill_chunk,
        outline=outline, request_id=request.request_id, api="grpc",
        top_logprobs=request.top_logprobs if request.HasField("top_logprobs") else None,
        prompt_logprobs=request.prompt_logprobs if request.HasField("prompt_logprobs") else None,
        json_schema=request.json_schema)
    return prompt, options


def stage_info(s: StageView) -> controller_pb2.StageInfo:
    return controller_pb2.StageInfo(node_id=s.node_id, address=s.address, start_layer=s.start, end_layer=s.end,
                                    device=s.device, parameter_count=s.parameter_count, pipeline=s.pipeline)


def timings_proto(t: Timings, c: Completion) -> controller_pb2.Timings:
    return controller_pb2.Timings(
        queue_s=t.queue_s, first_token_s=t.first_token_s, total_s=t.total_s, decode_tokens_per_s=t.decode_tokens_per_s,
        prompt_tokens=c.prompt_tokens, new_tokens=len(c.tokens), decode_steps=t.decode_steps, candidates=t.candidates,
        accepted=t.accepted, speculate=t.speculate, prefill_chunk=t.prefill_chunk, disaggregated=t.disaggregated,
        prefill_s=t.prefill_s, transfer_s=t.transfer_s, first_step_s=t.first_step_s)


def outline_reply(c: Completion) -> controller_pb2.SubmitReply:
    """The finished reply of an outline request: every point, the parser's repairs."""
    points = [controller_pb2.OutlinePoint(id=p.id, title=p.title, deps=list(p.deps), tokens=len(p.tokens),
                                          text=p.text, start_s=p.start, end_s=p.end, shared=p.shared)
              for p in c.points]
    return controller_pb2.SubmitReply(finished=True, finish_reason=c.finish_reason, points=points,
                                      warnings=c.warnings, timings=controller_pb2.Timings(
                                          total_s=time.monotonic() - c.submitted, new_tokens=len(c.tokens)))


def status_reply(snap: ControllerSnapshot) -> controller_pb2.ControllerStatusReply:
    st = snap.stats
    return controller_pb2.ControllerStatusReply(
        model_dir=snap.model_dir, plan_id=snap.plan_id, state=snap.phase.value, active_requests=snap.running,
        completed_requests=st.completed, plan_json=snap.plan_json, queued_requests=snap.queued,
        preemptions=st.preemptions, plan_generation=snap.plan_generation, micro_batches=snap.micro_batches,
        speculate=snap.speculate, decode_steps=st.decode_steps, decode_tokens=st.decode_tokens,
        candidates=st.candidates, candidates_accepted=st.candidates_accepted,
        tokens_per_step=st.decode_tokens / st.decode_steps if st.decode_steps else 0.0,
        acceptance_rate=st.candidates_accepted / st.candidates if st.candidates else 0.0,
        stages=[stage_info(s) for s in snap.stages], last_replan=snap.last_replan, last_replan_s=snap.last_replan_s,
        replans=snap.replans, waiting=snap.reason if snap.phase is Phase.WAITING else "", role=snap.role,
        epoch=snap.epoch, active=snap.active, journaled=snap.journaled, replays=st.replays,
        replay_tokens=st.replay_tokens, replay_cached_tokens=st.replay_cached_tokens, evacuated_requests=st.evacuated,
        journal=snap.journal, journal_damage=snap.journal_damage,
        pipelines=[controller_pb2.PipelineInfo(index=p.index, plan_id=p.plan_id, generation=p.generation,
                                               micro_batches=p.micro_batches, running=p.running,
                                               predicted_tokens_per_s=p.predicted_tokens_per_s, serving=p.serving,
                                               silent=p.silent)
                   for p in snap.pipelines],
        links=[controller_pb2.LinkInfo(src=a, dst=b, bandwidth=link.bandwidth, latency_s=link.latency)
               for a, out in sorted(snap.links.items()) for b, link in sorted(out.items())])


class ControllerServicer(controller_pb2_grpc.ControllerServicer):
    def __init__(self, app: ControllerApp, door: FrontDoor, transport: Transport,
                 authority: JoinAuthority | None = None, replicator=None):
        self.app = app
        self.replicator = replicator if replicator is not None else Replicator(app)  # a standby follows us
        self.door = door
        self.transport = transport  # the process's: who a caller is
        self.authority = authority  # --ca-dir: join tokens and revocations (None: refused)
        self.register_rate = RateCap(REGISTER_BURST, REGISTER_PER_S)

    async def Submit(self, request, context):
        prompt, options = submit_request(request)
        async with self.door.open(prompt, options, client_identity(self.transport, context)) as completion:
            async for reply in self._replies(completion, options.outline is not None):
                yield reply

    async def Resume(self, request, context):
        async with self.door.resume(request.request_id, request.have_tokens,
                                    client_identity(self.transport, context),
                                    have_points=tuple(request.have_points)) as completion:
            async for reply in self._replies(completion, completion.outline):
                yield reply

    async def Replicate(self, request, context):
        follower = check_id("follower", request.follower, empty_ok=True) or context.peer()
        async for op in self.replicator.follow(follower, self.transport.tls, self.transport.peer(context)[1],
                                               context.invocation_metadata()):
            yield op

    async def _replies(self, completion: Completion, outline: bool):
        """The stream of a completion's replies: its pieces, the stages on the first, the timings
        on the last (an outline request's points after its pieces)."""
        first = True
        async for piece in completion:
            reply = controller_pb2.SubmitReply(request_id=completion.id if not outline else "",
                                               token_ids=piece.token_ids, text=piece.text, point=piece.point,
                                               finished=piece.finished, finish_reason=piece.finish_reason,
                                               logprobs=[lp.to_proto() for lp in piece.logprobs if lp is not None])
            if first:  # the stages of the pipeline it runs on (an outline's: every pipeline's)
                pipeline = completion.handle.request.pipeline if completion.handle is not None else None
                reply.stages.extend(stage_info(s) for s in self.app.stage_views(pipeline))
                reply.prompt_logprobs.extend(lp.to_proto() for lp in completion.prompt_logprobs or ())
                first = False
            if piece.finished:
                reply.timings.CopyFrom(timings_proto(completion.timings(), completion))
            yield reply
        if outline:
            yield outline_reply(completion)

    async def Status(self, request, context):
        reply = status_reply(self.app.snapshot())
        members = list(self.app.members.by_address.values())
        probes = await asyncio.gather(*(self.app.pipelines.probe(m.address, timeout=STATUS_PROBE_TIMEOUT_S)
                                        for m in members), return_exceptions=True)
        in_plan = {h.address: p.index for p in self.app.pipelines.all for h in (*p.stages, *p.members)}
        for m, probe in zip(members, probes):
            node = controller_pb2.NodeStatus(address=m.address, node_id=m.node_id, source=m.source,
                                             in_plan=m.address in in_plan, drained=m.drained, down=m.why_not(),
                                             pipeline=in_plan.get(m.address, 0))
            if isinstance(probe, MeshError):
                node.error = str(probe)
            else:
                node.status.CopyFrom(probe)
                node.reachable = True
            reply.nodes.append(node)
        return reply

    async def Register(self, request, context):
        who = client_identity(self.transport, context)
        if not self.register_rate.take(who):
            raise ResourceExhausted(f"{who} is over the cap of {REGISTER_BURST} Register calls at once, "
                                    f"{REGISTER_PER_S:g} a second after that; a stage registers every few seconds: "
                                    "retry in a second")
        node_id = check_id("node_id", request.node_id)
        self._check_self(context, node_id)
        if not request.address:
            raise InvalidArgument("address must be the node's host:port (an empty host means the caller's)")
        raw = request.address  # ":PORT" and a wildcard host: the caller's host
        address = check_address("address", (caller_address(raw, context.peer()) if ":" in raw else "") or raw)
        self._check_silent(address)
        admitted, message = await self.app.commands.register(address, node_id)
        return controller_pb2.RegisterReply(controller_id=self.app.pipelines.owner, admitted=admitted, message=message)

    async def Leave(self, request, context):
        node_id = check_id("node_id", request.node_id)
        self._check_self(context, node_id)
        timeout = request.timeout_s if 0 < request.timeout_s <= MAX_LEAVE_S else DEFAULT_LEAVE_S
        moved, message = await self.app.commands.leave(node_id, timeout)
        return controller_pb2.LeaveReply(moved=moved, message=message)

    def _check_silent(self, address: str) -> None:
        """A new address is refused while MAX_SILENT_REGISTERED registered members do not answer
        (each is probed until it is forgotten, FORGET_AFTER_S after it went down)."""
        members = self.app.members.by_address
        if address in members:
            return
        silent = sum(1 for m in members.values() if m.source == "registered" and (m.down == NOT_PROBED or m.misses))
        if silent >= MAX_SILENT_REGISTERED:
            raise ResourceExhausted(f"{silent} registered nodes do not answer, the cap of {MAX_SILENT_REGISTERED}: "
                                    "a new address registers once they answer or are forgotten "
                                    f"({FORGET_AFTER_S:.0f} s after they went down)")

    def _check_self(self, context, node_id: str) -> None:
        """Over TLS, a stage speaks only for itself: `node_id` must be its certificate's name."""
        role, name = self.transport.peer(context)
        if role == STAGE and node_id != name:
            raise PermissionDenied(f"a stage certificate for {name!r} cannot speak for node {node_id!r}")

    async def Drain(self, request, context):
        if not request.node or len(request.node) > 256:
            raise InvalidArgument("node must be a node id or host:port of 1 to 256 characters")
        message = await self.app.commands.drain(request.node, undrain=request.undrain)
        return controller_pb2.DrainReply(plan_generation=self.app.pipelines.generation, message=message)

    async def PullWeights(self, request, context):
        key = next((v for k, v in context.invocation_metadata() or () if k == STREAM_KEY_HEADER), "")
        if not (isinstance(key, str) and self.app.pipelines.identity.assigned(key)):
            raise PermissionDenied("PullWeights serves only the stages this controller assigns (they send the "
                                   f"plan's stream key as {STREAM_KEY_HEADER}); assign the node from this controller")
        async for chunk in stream_weights(self.app.model_dir, self.app.digest, request, peer=context.peer()):
            yield chunk

    def _authority(self) -> JoinAuthority:
        if self.authority is None:
            raise FailedPrecondition("this controller has no CA to sign with: start it with --ca-dir DIR "
                                     "(and --join-listen HOST:PORT for nodes to join)")
        return self.authority

    async def CreateJoinToken(self, request, context):
        token, ttl = self._authority().create(request.ttl_s)
        return controller_pb2.JoinTokenReply(token=token, expires_in_s=ttl)

    async def Revoke(self, request, context):
        try:
            node_id = check_name(request.node)
        except TlsError as exc:
            raise InvalidArgument(f"node to revoke: {exc}") from exc
        self._authority()  # revocations are kept beside the CA (--ca-dir)
        return controller_pb2.RevokeReply(message=await self.app.commands.revoke(node_id))

    async def Plan(self, request, context):
        try:
            plan_json, table = await self.app.commands.plan_preview(request.strategy, request.objective,
                                                           list(request.boundaries))
        except ValueError as err:
            raise InvalidArgument(str(err)) from err
        return controller_pb2.PlanReply(plan_json=plan_json, table=table)


class JoinServicer(controller_pb2_grpc.ControllerServicer):
    """The bootstrap port (--join-listen): Join only, authenticated by the token (every other
    method answers UNIMPLEMENTED there)."""

    def __init__(self, authority: JoinAuthority):
        self.authority = authority

    async def Join(self, request, context):
        check_id("token_id", request.token_id)
        if len(request.csr_pem) > 16384 or len(request.mac) != 32:
            raise InvalidArgument("a join request carries a PEM signing request (under 16 KiB) and a 32-byte HMAC")
        cert, ca, mac = self.authority.join(request.token_id, request.csr_pem, request.mac)
        return controller_pb2.JoinReply(cert_pem=cert, ca_pem=ca, mac=mac)
