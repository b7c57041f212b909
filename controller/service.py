"""Controller gRPC servicer: translates between protobuf and the controller's domain types."""
from __future__ import annotations

import asyncio
import time


from logicpipe.common.transport import Transport, caller_address
from logicpipe.errors import FailedPrecondition, InvalidArgument, MeshError, PermissionDenied, ResourceExhausted
from logicpipe.limits import check_id
from logicpipe.policy import STAGE
from logicpipe.sampling import SamplingParams
from logicpipe.v1 import controller_pb2, controller_pb2_grpc
from logicpipe.controller.app import ControllerApp
from logicpipe.controller.scheduler import DEFAULT_MAX_TOKENS, Request


DEFAULT_LEAVE_S = 20.0  # a stopping node's Leave waits this long for its requests to move (unless it says)
MAX_LEAVE_S = 120.0
STATUS_PROBE_TIMEOUT_S = 1.0  # a node that does not answer Status this fast shows as unreachable (Status answers in 2 s)
MAX_PROMPT_CHARS = 2**20   # characters of one prompt (refused before any work beyond that)
MAX_PROMPT_TOKENS = 2**17  # token ids of one prompt
DEFAULT_POINT_TOKENS = 96  # outline requests: new tokens per point unless max_tokens says


class TextStream:
    """Incremental detokenization, O(1) per token: decode a short window from the last emitted
    boundary and emit what it adds (a partial UTF-8 character is held back until it completes)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start: a few tokens before `read`, so merges across it decode right
        self.read = 0    # tokens whose text has been emitted

    def push(self, token_ids: list[int], final: bool = False) -> str:
        self.ids.extend(token_ids)
        if self.tokenizer is None:
            return ""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = decode(self.ids[self.prefix:self.read])
        text = decode(self.ids[self.prefix:])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


def stage_infos(app: ControllerApp) -> list[controller_pb2.StageInfo]:
    return [controller_pb2.StageInfo(node_id=h.node_id, address=h.address, start_layer=h.start, end_layer=h.end,
                                     device=h.device, parameter_count=h.parameter_count)
            for h in app.pipeline.stages]


def timings_proto(req: Request) -> controller_pb2.Timings:
    n = len(req.tokens)
    decode = req.finished - req.first_token
    return controller_pb2.Timings(
        queue_s=req.opened - req.submitted, first_token_s=req.first_token - req.submitted,
        total_s=req.finished - req.submitted,
        decode_tokens_per_s=(n - 1) / decode if decode > 0 and n > 1 else 0.0,
        prompt_tokens=len(req.prompt_ids), new_tokens=n, decode_steps=req.decode_steps, candidates=req.candidates,
        accepted=req.accepted, speculate=req.speculate, prefill_chunk=req.prefill_chunk)


DEFAULT_REQUESTS_PER_CLIENT = 64


def client_identity(transport: Transport, context) -> str:
    """Who a call comes from: its certificate's name over TLS, else the peer's host."""
    role, name = transport.peer(context)
    if role:
        return f"{role}:{name}"
    return context.peer().rpartition(":")[0] or context.peer()


class ControllerServicer(controller_pb2_grpc.ControllerServicer):
    def __init__(self, app: ControllerApp, transport: Transport, requests_per_client: int = DEFAULT_REQUESTS_PER_CLIENT,
                 authority=None):
        self.app = app
        self.transport = transport  # the process's: who a caller is
        self.authority = authority  # controller.join.JoinAuthority (--ca-dir), or None
        self.requests_per_client = requests_per_client  # requests one client may have running at once
        self._running: dict[str, int] = {}

    async def Submit(self, request, context):
        who = client_identity(self.transport, context)
        n = self._running.get(who, 0)
        if n >= self.requests_per_client:
            raise ResourceExhausted(f"{who} has {n} requests running, the cap per client "
                                    f"(--max-requests-per-client); wait for one to finish")
        self._running[who] = n + 1
        try:
            async for reply in self._submit(request, context):
                yield reply
        finally:
            self._running[who] -= 1
            if not self._running[who]:
                del self._running[who]

    async def _submit(self, request, context):
        app = self.app
        if len(request.prompt) > MAX_PROMPT_CHARS or len(request.prompt_token_ids) > MAX_PROMPT_TOKENS:
            raise InvalidArgument(
                f"the prompt is {len(request.prompt)} characters / {len(request.prompt_token_ids)} token ids, "
                f"over the cap of {MAX_PROMPT_CHARS} characters / {MAX_PROMPT_TOKENS} ids")
        if request.outline:
            async for reply in self._outline(request):
                yield reply
            return
        if request.prompt_token_ids:
            prompt_ids = list(request.prompt_token_ids)
        elif request.messages:
            turns = [(m.role, m.content) for m in request.messages]
            if sum(len(c) for _, c in turns) > MAX_PROMPT_CHARS:
                raise InvalidArgument(f"the conversation is over the cap of {MAX_PROMPT_CHARS} characters")
            prompt_ids = await asyncio.to_thread(app.encode_chat, turns)
        elif request.prompt.strip():  # tokenizing takes ~0.5 s per MiB: off the event loop
            prompt_ids = await asyncio.to_thread(app.encode_prompt, request.prompt, request.raw)
        else:
            raise InvalidArgument("the prompt is empty: give a prompt or prompt_token_ids")
        sampling = SamplingParams.from_proto(request.sampling)
        max_tokens = request.max_tokens or DEFAULT_MAX_TOKENS
        text = TextStream(app.tokenizer)
        first = True
        speculate = request.speculate if request.HasField("speculate") else None
        async for update in app.scheduler.generate(prompt_ids, max_tokens, sampling, request.ignore_eos,
                                                   speculate=speculate, prefill_chunk=request.prefill_chunk):
            reply = controller_pb2.SubmitReply(request_id=update.request_id, token_ids=[update.token_id],
                                               text=text.push([update.token_id], update.finished),
                                               finished=update.finished, finish_reason=update.finish_reason)
            if first:
                reply.stages.extend(stage_infos(app))
                first = False
            if update.finished:
                reply.timings.CopyFrom(timings_proto(update.request))
            yield reply

    async def _outline(self, request):
        """An outline-DAG request: the outline's tokens (point 0), then every point's as they come,
        several points interleaved; the finished reply carries every point."""
        from logicpipe.controller.outline import OutlineRun

        app = self.app
        if app.tokenizer is None:
            raise InvalidArgument(f"the model at {app.model_dir} has no tokenizer: outline requests need one")
        if not request.prompt.strip():
            raise InvalidArgument("an outline request needs a prompt (the question)")
        if len(request.outline_text) > MAX_PROMPT_CHARS:
            raise InvalidArgument(f"outline_text is over the cap of {MAX_PROMPT_CHARS} characters")
        run = OutlineRun(app.scheduler, app.tokenizer, request.prompt, outline_text=request.outline_text,
                         max_points=request.max_points, point_tokens=request.max_tokens or DEFAULT_POINT_TOKENS,
                         sampling=SamplingParams.from_proto(request.sampling), sequential=request.sequential_points,
                         speculate=request.speculate if request.HasField("speculate") else None)
        streams: dict[int, TextStream] = {}
        request_id, first = "", True
        async for pid, token, finished in run.events():
            text = streams.setdefault(pid, TextStream(app.tokenizer)).push([token], finished)
            reply = controller_pb2.SubmitReply(request_id=request_id, token_ids=[token], text=text, point=pid)
            if first:
                reply.stages.extend(stage_infos(app))
                first = False
            yield reply
        points = [controller_pb2.OutlinePoint(id=p.id, title=p.title, deps=list(p.deps), tokens=len(p.tokens),
                                              text=p.text, start_s=p.start, end_s=p.end, shared=p.shared)
                  for p in run.points]
        total = time.monotonic() - run.submitted
        yield controller_pb2.SubmitReply(finished=True, finish_reason="stop", points=points, warnings=run.warnings,
                                         timings=controller_pb2.Timings(total_s=total, new_tokens=sum(
                                             len(p.tokens) for p in run.points) + len(run.outline_tokens)))

    async def Status(self, request, context):
        app = self.app
        reply = controller_pb2.ControllerStatusReply(
            model_dir=str(app.model_dir), plan_id=app.pipeline.plan_id, state=app.state,
            active_requests=app.scheduler.running, completed_requests=app.scheduler.completed,
            plan_json=app.plan_json, queued_requests=len(app.scheduler.waiting),
            preemptions=app.scheduler.preemptions, plan_generation=app.pipeline.generation,
            micro_batches=app.pipeline.micro_batches, speculate=app.scheduler.speculate)
        sched = app.scheduler
        reply.decode_steps, reply.decode_tokens = sched.decode_steps, sched.decode_tokens
        reply.candidates, reply.candidates_accepted = sched.candidates, sched.candidates_accepted
        reply.tokens_per_step = sched.decode_tokens / sched.decode_steps if sched.decode_steps else 0.0
        reply.acceptance_rate = sched.candidates_accepted / sched.candidates if sched.candidates else 0.0
        reply.stages.extend(stage_infos(app))
        reply.last_replan, reply.last_replan_s, reply.replans = app.last_replan, app.last_replan_s, app.replans
        reply.waiting = app.waiting if app.state == "waiting" else ""
        members = list(app.members.by_address.values())
        probes = await asyncio.gather(*(app.pipeline.probe(m.address, timeout=STATUS_PROBE_TIMEOUT_S) for m in members),
                                      return_exceptions=True)
        in_plan = {h.address for h in app.pipeline.stages}
        for m, probe in zip(members, probes):
            node = controller_pb2.NodeStatus(address=m.address, node_id=m.node_id, source=m.source,
                                             in_plan=m.address in in_plan, drained=m.drained, down=m.why_not())
            if isinstance(probe, MeshError):
                node.error = str(probe)
            else:
                node.status.CopyFrom(probe)
                node.reachable = True
            reply.nodes.append(node)
        return reply

    async def Register(self, request, context):
        node_id = check_id("node_id", request.node_id)
        self._check_self(context, node_id)
        address = caller_address(request.address, context.peer())
        if not address:
            raise InvalidArgument("address must be the node's host:port (an empty host means the caller's)")
        admitted, message = await self.app.register(address, node_id)
        return controller_pb2.RegisterReply(controller_id=self.app.pipeline.owner, admitted=admitted, message=message)

    async def Leave(self, request, context):
        node_id = check_id("node_id", request.node_id)
        self._check_self(context, node_id)
        timeout = request.timeout_s if 0 < request.timeout_s <= MAX_LEAVE_S else DEFAULT_LEAVE_S
        moved, message = await self.app.leave(node_id, timeout)
        return controller_pb2.LeaveReply(moved=moved, message=message)

    def _check_self(self, context, node_id: str) -> None:
        """Over TLS, a stage speaks only for itself: `node_id` must be its certificate's name."""
        role, name = self.transport.peer(context)
        if role == STAGE and node_id != name:
            raise PermissionDenied(f"a stage certificate for {name!r} cannot speak for node {node_id!r}")

    async def Drain(self, request, context):
        if not request.node or len(request.node) > 256:
            raise InvalidArgument("node must be a node id or host:port of 1 to 256 characters")
        message = await self.app.drain(request.node, undrain=request.undrain)
        return controller_pb2.DrainReply(plan_generation=self.app.pipeline.generation, message=message)

    async def PullWeights(self, request, context):
        from logicpipe.controller.weights_server import stream_weights

        async for chunk in stream_weights(self.app.model_dir, self.app.digest, request, peer=context.peer()):
            yield chunk

    def _authority(self):
        if self.authority is None:
            raise FailedPrecondition("this controller has no CA to sign with: start it with --ca-dir DIR "
                                     "(and --join-listen HOST:PORT for nodes to join)")
        return self.authority

    async def CreateJoinToken(self, request, context):
        token, ttl = self._authority().create(request.ttl_s)
        return controller_pb2.JoinTokenReply(token=token, expires_in_s=ttl)

    async def Revoke(self, request, context):
        node_id = check_id("node", request.node)
        self._authority()
        return controller_pb2.RevokeReply(message=await self.app.revoke(node_id))

    async def Plan(self, request, context):
        try:
            plan_json, table = await self.app.plan_preview(request.strategy, request.objective,
                                                           list(request.boundaries))
        except ValueError as err:
            raise InvalidArgument(str(err)) from err
        return controller_pb2.PlanReply(plan_json=plan_json, table=table)


class JoinServicer(controller_pb2_grpc.ControllerServicer):
    """The bootstrap port (--join-listen): Join only, authenticated by the token (every other
    method answers UNIMPLEMENTED there)."""

    def __init__(self, authority):
        self.authority = authority

    async def Join(self, request, context):
        check_id("token_id", request.token_id)
        if len(request.csr_pem) > 16384 or len(request.mac) != 32:
            raise InvalidArgument("a join request carries a PEM signing request (under 16 KiB) and a 32-byte HMAC")
        cert, ca, mac = self.authority.join(request.token_id, request.csr_pem, request.mac)
        return controller_pb2.JoinReply(cert_pem=cert, ca_pem=ca, mac=mac)
