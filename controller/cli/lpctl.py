"""`lpctl`: submit prompts to a LogicPipe mesh and inspect it, from any machine."""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import ssl
import sys
import time
import uuid

# gRPC's own INFO lines (a failed TLS handshake, logged by its core) would come before lpctl's one
# line that names the fix; GRPC_VERBOSITY=debug (or info) shows them again. Set before gRPC loads.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc
from google.protobuf.json_format import MessageToDict

from logicpipe.common.modeldir import ModelError
from logicpipe.common.process import CONTROLLER_PORT, EXIT_USAGE, address_list_flag, exit_after
from logicpipe.common.security import ca
from logicpipe.common.security.bundle import CA_CERT, CA_KEY, Bundle, TlsError
from logicpipe.common.transport import PLAINTEXT, Transport
from logicpipe.controller.cli.gguf_convert import DTYPES, prepare_gguf
from logicpipe.controller.cli.model_prep import GGUF_DTYPE, prepare_default_model
from logicpipe.controller.mesh.planning import plan_from_profiles_file, replicas_flag
from logicpipe.errors import MeshError
from logicpipe.sampling import SamplingParams
from logicpipe.v1 import controller_pb2, controller_pb2_grpc

DEFAULT_CONTROLLER = f"127.0.0.1:{CONTROLLER_PORT}"


RESUME_RETRY_S = 0.3  # a broken stream is resumed again this often until --resume-s runs out


def _controllers(args) -> list[str]:
    return list(args.controller) or [DEFAULT_CONTROLLER]  # HOST:PORT each (address_list_flag)


_CHANNELS: list[grpc.Channel] = []  # every channel lpctl opened: closed before it exits (close_channels)


def _stub_at(args, address: str):
    transport = Transport(Bundle.load(args.tls_dir)) if args.tls_dir else PLAINTEXT
    channel = transport.sync_channel(address, "controller")
    _CHANNELS.append(channel)
    return controller_pb2_grpc.ControllerStub(channel)


def close_channels(since: int = 0) -> None:
    """Close the channels opened since the `since`-th (default: all). A channel left to the
    interpreter's shutdown (one whose stream broke, say, before a resume) can hang the exit in
    gRPC's finaliser: lpctl printed its answer and never returned. Closing cancels whatever call
    is still open on it."""
    while len(_CHANNELS) > since:
        _CHANNELS.pop().close()


def _stub(args):
    """A stub of the controller at --controller (over mutual TLS with --tls-dir's bundle if given);
    of several (an active and a standby), the one that answers as active, else the first."""
    addresses = _controllers(args)
    if len(addresses) > 1:
        for a in addresses:
            try:
                if _stub_at(args, a).Status(controller_pb2.ControllerStatusRequest(), timeout=2.0).role != "standby":
                    return _stub_at(args, a)
            except grpc.RpcError:
                continue
    return _stub_at(args, addresses[0])


def _resumable(exc: grpc.RpcError) -> bool:
    """The stream broke on the controller's side (it stopped, died, or is not the active one now)."""
    details = exc.details() or ""
    return (exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            or exc.code() == grpc.StatusCode.FAILED_PRECONDITION and
            (details.startswith("standby:") or "replaced by a newer one" in details))


PROBE_TIMEOUT_S = 3.0  # a failed call's address is probed this long at most, to say why it failed


def probe(address: str, timeout: float = PROBE_TIMEOUT_S) -> str:
    """What listens at `address`: "refused" (nothing), "unreachable" (no route, no answer, no such
    name), "tls" (it answers a TLS hello), "plaintext" (it answers one with what is not TLS: a
    gRPC server without TLS writes HTTP/2) or "silent" (it accepted, then hung up or said nothing
    in time: a server stopping, or too busy; that tells neither). The handshake offers no
    certificate and checks none: it only asks whether TLS answers there."""
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except ConnectionRefusedError:
        return "refused"
    except (ConnectionResetError, ConnectionAbortedError):  # accepted and reset before connect() returned:
        return "silent"  # the same hang-up as below, only sooner (CI saw it called "unreachable")
    except (OSError, ValueError):
        return "unreachable"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with context.wrap_socket(sock):
            return "tls"
    except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError):
        return "silent"  # a hang-up mid-handshake
    except ssl.SSLError as exc:  # an alert (a certificate wanted, ...) is TLS too; bytes that are not TLS are not
        return "tls" if "ALERT" in (exc.reason or "") else "plaintext"
    except OSError:  # a reset or a timeout: CI saw one taken for "plaintext", so lpctl gave up on a controller
        return "silent"  # taking over instead of resuming (a TLS mismatch is the one error no waiting mends)
    finally:
        sock.close()


def diagnose(args, exc: grpc.RpcError) -> tuple[bool, str]:
    """A call that got no answer from the controller (UNAVAILABLE): whether waiting cannot mend it
    (a TLS mismatch), and one line naming the fix: nothing listens there, plaintext to a TLS
    controller or TLS to a plaintext one, a certificate of another CA, else gRPC's reason in short.
    Every command that dials says it this way (call_error)."""
    details = exc.details() or exc.code().name
    found = {a: probe(a) for a in _controllers(args)}
    address, what = next(((a, w) for a, w in found.items() if w != "refused"), next(iter(found.items())))
    tls_dir = args.tls_dir
    if what == "refused":
        return False, (f"nothing listens at {', '.join(found)} (connection refused): is the controller up? Give "
                       f"its address with --controller HOST:PORT (default port {CONTROLLER_PORT})")
    if what == "unreachable":
        return False, f"{address} cannot be reached ({short_error(details)}): check --controller HOST:PORT"
    if what == "tls" and not tls_dir:
        return True, (f"the controller at {address} speaks mutual TLS: give --tls-dir DIR with a client "
                      "certificate (lpctl ca issue NAME --role client)")
    if what == "plaintext" and tls_dir:
        return True, (f"the controller at {address} speaks plaintext, not TLS: leave out --tls-dir {tls_dir} (or "
                      "start the controller with --tls-dir)")
    if what == "tls" and any(w in details.lower() for w in ("handshake", "certificate")):
        return True, (f"the TLS handshake with {address} failed ({short_error(details)}): --tls-dir {tls_dir} must "
                      "be a client bundle of the controller's CA (lpctl ca issue NAME --role client --dir THAT-CA)")
    return False, f"{address}: {exc.code().name}: {short_error(details)}; is the controller up at --controller?"


def call_error(args, exc: grpc.RpcError) -> str:
    """A failed call as the one line lpctl prints (without "lpctl: ")."""
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        return diagnose(args, exc)[1]
    return f"{exc.code().name}: {exc.details()}"


def stream_resuming(args, req: controller_pb2.SubmitRequest):
    """The replies of `req`, however often the controller stops, dies or hands over meanwhile: a
    broken stream is resumed by the request's id (made here) from the tokens already received, at
    whichever of --controller answers as active, for up to --resume-s. Without a journal entry
    (never admitted, or lost) it is submitted again under the same id, its tokens up to those held
    skipped: replay is exact, and a sampled request carries its seed (drawn here when not given).
    Closing the generator, or a Ctrl-C while it waits, cancels the call under way."""
    req.request_id = req.request_id or uuid.uuid4().hex
    if req.sampling.temperature > 0 and not req.sampling.HasField("seed"):
        req.sampling.seed = random.getrandbits(63)
    held: dict[int, int] = {}  # tokens received of each point (an outline's; a plain request's are all point 0)
    broke, resume, answered = 0.0, False, False
    call, opened = None, len(_CHANNELS)
    try:
        while True:
            skip: dict[int, int] = {}
            try:
                close_channels(opened)  # the broken stream's channel, if any (its calls are over)
                stub = _stub(args)
                if resume:
                    have = controller_pb2.ResumeRequest(request_id=req.request_id, have_tokens=sum(held.values()))
                    if req.outline:
                        have.have_points.extend(held.get(p, 0) for p in range(max(held, default=-1) + 1))
                    try:
                        call = stub.Resume(have, timeout=args.timeout)
                        first = next(call)
                    except grpc.RpcError as exc:
                        if exc.code() != grpc.StatusCode.NOT_FOUND:
                            raise
                        # not journaled: again, from the start
                        call, skip = stub.Submit(req, timeout=args.timeout), dict(held)
                        first = next(call)
                else:
                    call = stub.Submit(req, timeout=args.timeout)
                    first = next(call)
                answered = True
                if broke:
                    print(f"[lpctl: resumed request {req.request_id} after {time.monotonic() - broke:.1f} s]",
                          file=sys.stderr)
                broke = 0.0
                for reply in _chain(first, call):
                    if skip.get(reply.point):  # the tokens of a submitted-again request that the client holds
                        n = min(skip[reply.point], len(reply.token_ids))
                        skip[reply.point] -= n
                        if n and not reply.finished:
                            continue
                        del reply.token_ids[:n]
                        if n:
                            reply.text = ""
                    held[reply.point] = held.get(reply.point, 0) + len(reply.token_ids)
                    yield reply
                return
            except StopIteration:
                return
            except grpc.RpcError as exc:
                if not _resumable(exc) or args.resume_s <= 0:
                    raise
                broke = broke or time.monotonic()
                if time.monotonic() - broke > args.resume_s:
                    raise
                if not resume and not answered and exc.code() == grpc.StatusCode.UNAVAILABLE:
                    lasting, line = diagnose(args, exc)
                    if lasting:  # a TLS mismatch: no waiting mends it
                        raise
                    print(f"[lpctl: {line}; trying again for up to {args.resume_s:.0f} s (--resume-s), as request "
                          f"{req.request_id}]", file=sys.stderr)
                elif not resume:
                    print(f"[lpctl: {exc.code().name}: {exc.details()}; resuming request {req.request_id}]",
                          file=sys.stderr)
                resume = True
                time.sleep(RESUME_RETRY_S)
    except (GeneratorExit, KeyboardInterrupt):  # closed (a Ctrl-C): the call under way is cancelled
        if call is not None:
            call.cancel()
        raise
    finally:
        close_channels(opened)


def _chain(first, rest):
    yield first
    yield from rest


CHAT_KEYS = ("Ctrl-C stops an answer (what was said stays in the history); at the prompt Ctrl-C, Ctrl-D or /exit "
             "ends, /reset forgets the history")


def cmd_chat(args) -> int:
    """An interactive conversation: history kept, tokens streamed, the keys as CHAT_KEYS says; an
    answer cut by --max-tokens is marked so (on stderr, so that stdout stays the answers)."""
    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed).validate()
    except ValueError as exc:
        print(f"lpctl: {exc}", file=sys.stderr)
        return 2
    stub = _stub(args)
    stub.Status(controller_pb2.ControllerStatusRequest(), timeout=min(args.timeout, 10.0))  # no answer: say why now
    system = [controller_pb2.ChatMessage(role="system", content=args.system)] if args.system else []
    history = list(system)
    prompt = "you> " if sys.stdin.isatty() else ""
    print(f"chat with the mesh: {CHAT_KEYS}", file=sys.stderr)
    while True:
        try:
            line = input(prompt)
        except EOFError:
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            history = list(system)
            print("(history forgotten)", file=sys.stderr)
            continue
        history.append(controller_pb2.ChatMessage(role="user", content=line))
        # a broken stream (the controller stopped, died, or handed over) is resumed as `lpctl submit` does
        replies = stream_resuming(args, controller_pb2.SubmitRequest(
            messages=history, max_tokens=args.max_tokens, sampling=sampling.to_proto()))
        answer, reason = [], ""
        try:
            for reply in replies:
                answer.append(reply.text)
                sys.stdout.write(reply.text)
                sys.stdout.flush()
                reason = reply.finish_reason or reason
        except KeyboardInterrupt:  # (the call was cancelled by stream_resuming)
            sys.stdout.write(" [stopped]")
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                history.pop()
                print(f"\nlpctl: {call_error(args, exc)}", file=sys.stderr)
                continue
        if reason == "length":
            print(f" {cut_marker(args.max_tokens)}", end="", file=sys.stderr, flush=True)
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append(controller_pb2.ChatMessage(role="assistant", content="".join(answer)))


def cut_marker(max_tokens: int) -> str:
    """What follows an answer that ended at --max-tokens, not where the model stopped."""
    return f"[cut at --max-tokens {max_tokens}]"


def cmd_token(args) -> int:
    reply = _stub(args).CreateJoinToken(controller_pb2.JoinTokenRequest(ttl_s=args.ttl), timeout=args.timeout)
    if args.json:
        print(json.dumps({"token": reply.token, "expires_in_s": reply.expires_in_s}))
    else:
        print(reply.token)
        print(f"good once, for {reply.expires_in_s / 60:.0f} min: logicpipe-stage --join-token {reply.token} "
              "--join-address CONTROLLER:JOINPORT --tls-dir DIR ...", file=sys.stderr)
    return 0


def cmd_revoke(args) -> int:
    print(_stub(args).Revoke(controller_pb2.RevokeRequest(node=args.node), timeout=args.timeout).message)
    return 0


def cmd_ca(args) -> int:
    try:
        if args.action == "init":
            d = ca.init_ca(args.dir)
            print(f"made a CA in {d}: keep {d / CA_KEY} secret (it signs every party of the mesh); "
                  f"give only {CA_CERT} away (every bundle carries it)")
        else:
            if not args.name or not args.role:
                print("lpctl: ca issue needs NAME and --role controller|stage|client", file=sys.stderr)
                return 2
            out = ca.issue(args.dir, args.name, args.role, args.out or args.name)
            print(f"wrote {out}/{CA_CERT}, {args.name}.crt, {args.name}.key: start the {args.role} with "
                  f"--tls-dir {out}")
    except TlsError as exc:
        print(f"lpctl: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_submit(args) -> int:
    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed).validate()
    except ValueError as exc:
        print(f"lpctl: {exc}", file=sys.stderr)
        return 2
    req = controller_pb2.SubmitRequest(prompt=args.prompt, raw=args.raw, max_tokens=args.max_tokens,
                                       sampling=sampling.to_proto(), ignore_eos=args.ignore_eos)
    if args.speculate is not None:
        req.speculate = args.speculate
    req.prefill_chunk = args.prefill_chunk
    if args.json_schema:  # structured output: the answer validates against it ("json_object": any JSON object)
        try:
            req.json_schema = "json_object" if args.json_schema == "json_object" else open(
                args.json_schema, encoding="utf-8").read()
        except OSError as exc:
            print(f"lpctl: --json-schema {args.json_schema}: {exc.strerror or exc}; give a file holding a JSON "
                  "schema, or json_object", file=sys.stderr)
            return 2
    if args.outline or args.outline_text:
        req.outline, req.max_points, req.sequential_points = True, args.max_points, args.sequential
        if args.outline_text:
            req.outline_text = open(args.outline_text, encoding="utf-8").read()
        return _submit_outline(args, req)
    text, ids, stages, timings, reason = [], [], [], None, ""
    for reply in stream_resuming(args, req):
        ids.extend(reply.token_ids)
        text.append(reply.text)
        if reply.stages:
            stages = [{"node_id": s.node_id, "address": s.address, "layers": [s.start_layer, s.end_layer],
                       "device": s.device, "parameters": s.parameter_count} for s in reply.stages]
        if reply.finished:
            timings, reason = reply.timings, reply.finish_reason
        if not args.json:
            sys.stdout.write(reply.text)
            sys.stdout.flush()
    if args.json:
        out = {"text": "".join(text), "token_ids": ids, "stages": stages, "finish_reason": reason,
               "request_id": req.request_id,
               "timings": timings_json(timings) if timings is not None else {}}
        print(json.dumps(out))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        if reason == "length":
            print(cut_marker(args.max_tokens), file=sys.stderr)
        if timings is not None and args.verbose:
            t = timings_json(timings)
            spec = (f", {t['tokens_per_step']:.2f} tokens/step, {t['acceptance_rate']:.0%} of "
                    f"{t['candidates']} candidates accepted" if t["candidates"] else "")
            split = (f" (prefill {t['prefill_s'] * 1000:.0f} + transfer {t['transfer_s'] * 1000:.0f} + first step "
                     f"{t['first_step_s'] * 1000:.0f} ms)" if timings.disaggregated else "")
            print(f"[{timings.new_tokens} tokens, first after {timings.first_token_s * 1000:.0f} ms{split}, "
                  f"{timings.decode_tokens_per_s:.1f} tokens/s{spec}, {reason}]", file=sys.stderr)
    return 0


def timings_json(t) -> dict:
    """A request's timings as --json prints them (with candidates: tokens per pipeline trip and the
    share of candidates accepted)."""
    return {"queue_s": t.queue_s, "first_token_s": t.first_token_s, "total_s": t.total_s,
            "decode_tokens_per_s": t.decode_tokens_per_s, "prompt_tokens": t.prompt_tokens,
            "new_tokens": t.new_tokens, "prefill_chunk": t.prefill_chunk, "speculate": t.speculate,
            "decode_steps": t.decode_steps, "tokens_per_step": t.new_tokens / t.decode_steps if t.decode_steps else 0.0,
            "candidates": t.candidates, "accepted": t.accepted,
            "acceptance_rate": t.accepted / t.candidates if t.candidates else 0.0,
            **({"disaggregated": True, "prefill_s": t.prefill_s, "transfer_s": t.transfer_s,
                "first_step_s": t.first_step_s} if t.disaggregated else {})}


def _submit_outline(args, req) -> int:
    """An outline request: progress per point on stderr while it runs, then the answer in outline
    order (or, --json, the answer and the DAG)."""
    counts: dict[int, int] = {}
    final = None
    for reply in stream_resuming(args, req):  # journaled: a controller that dies meanwhile does not lose it
        if reply.finished:
            final = reply
            break
        counts[reply.point] = counts.get(reply.point, 0) + len(reply.token_ids)
        if not args.json:
            progress = "  ".join(f"{'outline' if p == 0 else f'point {p}'}: {n}" for p, n in sorted(counts.items()))
            print(f"\r[{progress}]", end="", file=sys.stderr, flush=True)
    if not args.json:
        print(file=sys.stderr)
    points = list(final.points) if final is not None else []
    answer = "\n\n".join(f"{p.id}. {p.title}\n{p.text}" for p in points)
    if args.json:
        print(json.dumps({"text": answer, "warnings": list(final.warnings) if final else [], "dag": {"points": [
            {"id": p.id, "title": p.title, "deps": list(p.deps), "tokens": p.tokens, "text": p.text,
             "shared": p.shared, "timings": {"start_s": p.start_s, "end_s": p.end_s}} for p in points]},
            "timings": {"total_s": final.timings.total_s, "new_tokens": final.timings.new_tokens} if final else {}}))
    else:
        print(answer)
        if args.verbose and final is not None:
            for w in final.warnings:
                print(f"[outline: {w}]", file=sys.stderr)
            print(f"[{len(points)} points, {final.timings.new_tokens} tokens in {final.timings.total_s:.1f} s]",
                  file=sys.stderr)
    return 0


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(line.rstrip() for line in [fmt.format(*header), fmt.format(*("-" * w for w in widths))] +
                     [fmt.format(*map(str, r)) for r in rows])


ERROR_WIDTH = 80  # an error in a table cell or a status line: one line, this wide at most

_ERROR_NOISE = (  # what gRPC and the probe wrap around the reason (the address has its own column)
    re.compile(r"^stage node \S+ is unreachable: "),
    re.compile(r"failed to connect to all addresses; last error: "),
    re.compile(r"^(?:[A-Z_]+: )?(?:ipv4|ipv6|unix|unix-abstract|dns):\S+: "),
    re.compile(r"^Failed to connect to remote host: (?:connect: )?"),
)


def short_error(text: str, width: int = ERROR_WIDTH) -> str:
    """A node's error as one compact line: gRPC's "failed to connect to all addresses; last error:
    UNKNOWN: ipv4:10.0.0.7:50061: Failed to connect to remote host: connect: Connection refused (111)"
    (~200 columns in a table) becomes "Connection refused"; a TLS failure its OpenSSL reason
    ("TLS handshake failed: CERTIFICATE_VERIFY_FAILED"), a DNS failure "name not resolved: ..."; anything
    else its first line, cut at `width`.
    `lpctl nodes --json` keeps the whole text."""
    line = " ".join(next((s for s in text.splitlines() if s.strip()), "").split())
    for noise in _ERROR_NOISE:
        line = noise.sub("", line)
    line = re.sub(r" \(\d+\)$", "", line)  # the errno after "Connection refused"
    if "handshake failed" in line.lower():  # OpenSSL's reason ("error:100000f7:SSL routines:...:WRONG_VERSION_NUMBER")
        reason = re.search(r"error:[0-9a-fA-F]+:[^:]*:[^:]*:([A-Z0-9_]+)", line) or re.search(r"\((TSI_\w+)\)", line)
        line = "TLS handshake failed" + (f": {reason.group(1)}" if reason else "")
    elif line.startswith(("errors resolving ", "DNS resolution failed")):
        line = "name not resolved: " + line.rstrip("]").rsplit(":", 1)[-1].strip()
    line = line or "unreachable"
    return line if len(line) <= width else line[:width - 1] + "…"


def status_lines(st: controller_pb2.ControllerStatusReply) -> list[str]:
    """`lpctl status` as printed: the controller, the plan in force (a stage whose node is being
    drained is marked), then the nodes outside the plan in one line each: drained, unreachable
    (why, in one short line) or otherwise left out."""
    lines = [f"state {st.state}  plan {st.plan_id or '-'} (generation {st.plan_generation})  model {st.model_dir}"]
    if st.waiting:
        lines.append(f"waiting: {st.waiting}")
    if st.last_replan:
        lines.append(f"last re-plan: {st.last_replan} (serving {st.last_replan_s:.1f} s later; "
                     f"{st.replans} plans so far)")
    lines.append(f"requests: {st.active_requests} active, {st.queued_requests} queued, "
                 f"{st.completed_requests} completed")
    if st.journal:
        lines.append(f"journal: {st.journal}; {st.journaled} requests, fencing epoch {st.epoch}")
    if st.journal_damage:
        lines.append(f"JOURNAL DAMAGED: {st.journal_damage}")
    spec = f"{st.tokens_per_step:.2f} tokens per pipeline trip" if st.decode_steps else "no tokens yet"
    if st.candidates:
        spec += f", {st.acceptance_rate:.0%} of {st.candidates} candidates accepted"
    lines.append(f"decode: {spec} (--speculate {st.speculate})")
    if len(st.pipelines) > 1:
        lines.append(f"pipelines: {len(st.pipelines)} (replicas; each request runs on one)")
        for p in st.pipelines:
            n = sum(1 for s in st.stages if s.pipeline == p.index)
            predicted = f", {p.predicted_tokens_per_s:.0f} tok/s predicted" if p.predicted_tokens_per_s else ""
            lines.append(f"  pipeline {p.index}: {n} stage{'s' if n != 1 else ''}, {p.running} running"
                         f"{predicted}{'' if p.serving else ', not serving'}"
                         f"{f', silent: {p.silent} does not answer' if p.silent else ''}")
    lines.append("")
    drained = {n.address for n in st.nodes if n.drained}
    several = len(st.pipelines) > 1
    position: dict[int, int] = {}
    rows = []
    for s in st.stages:
        i = position[s.pipeline] = position.get(s.pipeline, -1) + 1  # a stage's place in its own pipeline
        rows.append(([s.pipeline] if several else []) + [i, s.node_id, s.address, f"{s.start_layer}-{s.end_layer - 1}",
                                                         s.device, f"{s.parameter_count:,}",
                                                         "draining" if s.address in drained else ""])
    header = (["pipeline"] if several else []) + ["stage", "node", "address", "layers", "device", "parameters", ""]
    if not drained & {s.address for s in st.stages}:
        rows, header = [r[:-1] for r in rows], header[:-1]
    lines += _table(rows, header).splitlines()
    out = [n for n in st.nodes if not n.in_plan and (n.drained or not n.reachable or n.down)]
    if out:
        lines.append("")
    for n in out:
        name = f"{n.node_id} ({n.address})" if n.node_id else n.address
        why = ("drained" if n.drained else f"unreachable: {short_error(n.error)}" if not n.reachable
               else short_error(n.down))
        lines.append(f"node {name}: {why}")
    return lines


def cmd_status(args) -> int:
    st = _stub(args).Status(controller_pb2.ControllerStatusRequest(), timeout=args.timeout)
    if args.json:
        print(json.dumps(MessageToDict(st, preserving_proto_field_name=True)))
        return 0
    print("\n".join(status_lines(st)))
    return 0


NODE_HEADER = ["address", "node", "found by", "state", "device", "layers", "format", "sessions", "speed", "memory",
               "use"]


def node_rows(st: controller_pb2.ControllerStatusReply, full_errors: bool = False) -> list[list[str]]:
    """`lpctl nodes`' rows (NODE_HEADER). Layers are those of the plan in force: a drained node
    says "drained" and another node outside the plan "-", not the layers it held in an older plan
    (its own Status still reports them). An unreachable node's error is one short line
    (short_error) unless `full_errors` (--json)."""
    rows = []
    for n in st.nodes:
        s = n.status
        use = (("in plan" + (f" (pipeline {n.pipeline})" if len(st.pipelines) > 1 else "")) if n.in_plan
               else ("drained" if n.drained else (n.down or "spare")))
        if not full_errors:
            use = short_error(use)
        if not n.reachable:
            error = n.error if full_errors else short_error(n.error)
            rows.append([n.address, n.node_id or "-", n.source, "unreachable", "-",
                         "drained" if n.drained else "-", "-", "-", "-", "-", error])
            continue
        p = s.profile
        layers = "drained" if n.drained else f"{s.start_layer}-{s.end_layer - 1}" if n.in_plan and s.end_layer else "-"
        rows.append([n.address, s.node_id, n.source, s.state, s.device, layers,
                     f"{(s.weight_format if n.in_plan else '') or '-'} (offers {'/'.join(p.weight_formats) or '?'})",
                     str(s.open_sessions), f"{p.flops / 1e9:.0f} GFLOP/s" if p.flops else "-",
                     f"{p.memory_bytes / 2**30:.1f} GiB" if p.memory_bytes else "-", use])
    return rows


def cmd_nodes(args) -> int:
    st = _stub(args).Status(controller_pb2.ControllerStatusRequest(), timeout=args.timeout)
    if args.json:
        print(json.dumps([dict(zip(NODE_HEADER, map(str, r))) for r in node_rows(st, full_errors=True)]))
    else:
        print(_table(node_rows(st), NODE_HEADER))
    return 0


def cmd_drain(args) -> int:
    reply = _stub(args).Drain(controller_pb2.DrainRequest(node=args.node, undrain=args.undrain), timeout=args.timeout)
    print(reply.message)
    return 0


def cmd_plan(args) -> int:
    if args.profiles:
        plan_json, table = plan_from_profiles_file(args.profiles, args.model, args.strategy, args.objective,
                                                   args.boundaries, args.context, replicas=args.replicas,
                                                   concurrency=args.concurrency)
    else:
        reply = _stub(args).Plan(controller_pb2.PlanRequest(
            strategy=args.strategy or "", objective=args.objective, boundaries=args.boundaries or []),
            timeout=args.timeout)
        plan_json, table = reply.plan_json, reply.table
    print(plan_json if args.json else table)
    return 0


def cmd_model(args) -> int:
    def say(message: str) -> None:  # progress on stderr, the directory on stdout
        print(message, file=sys.stderr)

    if args.gguf:
        out = prepare_gguf(args.gguf, args.out, dtype=args.dtype or GGUF_DTYPE, force=args.force, progress=say)
    elif args.dtype:
        raise ModelError("--dtype is for --gguf FILE (the embedded default model is float32)")
    else:
        out = prepare_default_model(args.out, force=args.force, progress=say)
    print(out)
    return 0


def positive_int(text: str, low: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not low <= value < 2**31:
        raise argparse.ArgumentTypeError(f"{value} is not between {low} and 2^31 - 1")
    return value


def non_negative_int(text: str) -> int:
    return positive_int(text, low=0)


def add_sampling_flags(p) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="lpctl", description="Talk to a LogicPipe controller.")
    ap.add_argument("--controller", default=DEFAULT_CONTROLLER, type=address_list_flag(CONTROLLER_PORT),
                    help="controller HOST:PORT, or several comma-separated (an active and its standby: the active one "
                         "is used, and a broken stream resumes at whichever is active then; a HOST alone means port "
                         f"{CONTROLLER_PORT}; default %(default)s)")
    ap.add_argument("--resume-s", type=float, default=120.0,
                    help="submit: a stream broken by the controller (restart, takeover) is resumed for this long "
                         "(0 = never; default %(default)s)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up on a call")
    ap.add_argument("--tls-dir", default="", metavar="DIR",
                    help="a client certificate bundle (`lpctl ca issue NAME --role client`) for a mesh with mutual TLS")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("submit", help="generate from a prompt; tokens stream as they come")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="new tokens at most (default %(default)s)")
    p.add_argument("--json-schema", default="", metavar="FILE",
                   help="structured output: the answer is JSON that validates against the schema in FILE "
                        "(json_object: any JSON object)")
    add_sampling_flags(p)
    p.add_argument("--raw", action="store_true", help="no chat template: tokenize the prompt as is")
    p.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens even past the model's stop tokens")
    p.add_argument("--json", action="store_true", help='print one JSON object {"text","token_ids","stages","timings"}')
    p.add_argument("-v", "--verbose", action="store_true", help="print timings after the text (stderr)")
    p.add_argument("--outline", action="store_true",
                   help="outline-DAG request: the model outlines points with dependencies, the points decode in "
                        "parallel; --max-tokens is then per point")
    p.add_argument("--outline-text", default=None, metavar="FILE",
                   help="with --outline: use this outline (lines `N. Content. [deps]`) instead of asking the model")
    p.add_argument("--max-points", type=positive_int, default=8, help="with --outline: points at most (default 8)")
    p.add_argument("--sequential", action="store_true", help="with --outline: decode points one after another")
    p.add_argument("--speculate", type=non_negative_int, default=None, metavar="K",
                   help="candidate tokens per step at most (0 = off; default: the controller's --speculate)")
    p.add_argument("--prefill-chunk", type=non_negative_int, default=0, metavar="TOKENS",
                   help="prompt tokens per step (default 0: the controller's choice)")
    p.set_defaults(fn=cmd_submit)

    p = sub.add_parser("chat", help="an interactive conversation (history kept; Ctrl-C stops an answer)",
                       description=f"An interactive conversation with the mesh: {CHAT_KEYS}. An answer that "
                                   "reached --max-tokens ends with [cut at --max-tokens N] (on stderr).")
    p.add_argument("--system", default="", help="a system message that starts the conversation")
    p.add_argument("--max-tokens", type=positive_int, default=256, help="new tokens per answer at most (default %(default)s)")
    add_sampling_flags(p)
    p.set_defaults(fn=cmd_chat)

    p = sub.add_parser("status", help="the plan in force and the request counts")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("nodes", help="every stage node: state, device, profile")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_nodes)

    p = sub.add_parser("drain", help="take a node out of the plan (its requests move to the others, none is lost)")
    p.add_argument("node", help="node id or HOST:PORT")
    p.set_defaults(fn=cmd_drain, undrain=False)

    p = sub.add_parser("undrain", help="let a drained node back into planning")
    p.add_argument("node", help="node id or HOST:PORT")
    p.set_defaults(fn=cmd_drain, undrain=True)

    p = sub.add_parser("plan", help="show a plan: the one in force, another strategy, or one from a profiles file")
    p.add_argument("--profiles", default=None, help="profiles JSON file: plan offline, no controller needed")
    p.add_argument("--model", default=None, help="with --profiles: model directory (default: the embedded model)")
    p.add_argument("--strategy", default=None, help="dp | uniform | memory | compute | mixed | custom")
    p.add_argument("--objective", default="throughput", choices=["throughput", "latency"])
    p.add_argument("--boundaries", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="custom strategy: layer boundaries between stages, e.g. 10,20")
    p.add_argument("--context", type=int, default=2048, help="with --profiles: context length to hold KV for")
    p.add_argument("--replicas", default="auto", type=replicas_flag, metavar="auto|N",
                   help="with --profiles: pipelines at most (auto: the planner's choice; 1: one pipeline)")
    p.add_argument("--concurrency", type=int, default=8, metavar="N",
                   help="with --profiles: requests at once the plan is costed for (default %(default)s)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("token", help="join tokens: `token create` makes a one-time token a new node joins with")
    p.add_argument("action", choices=["create"])
    p.add_argument("--ttl", type=float, default=3600.0, help="seconds the token can be used (default 1 hour)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_token)

    p = sub.add_parser("revoke", help="drop a node from the mesh and refuse its certificate from then on")
    p.add_argument("node", help="node id (its certificate's name)")
    p.set_defaults(fn=cmd_revoke)

    p = sub.add_parser("ca", help="the mesh's certificate authority: init once, then issue a bundle per party")
    p.add_argument("action", choices=["init", "issue"])
    p.add_argument("name", nargs="?", default="", help="issue: the party's name (a stage's node id)")
    p.add_argument("--role", choices=["controller", "stage", "client"], help="issue: what the party may do")
    p.add_argument("--dir", required=True, help="the CA's directory (ca.key, ca.crt)")
    p.add_argument("--out", default="", help="issue: where to write the bundle (default ./NAME)")
    p.set_defaults(fn=cmd_ca)

    p = sub.add_parser("model", help="prepare a model directory from a GGUF file (default: the embedded model), once")
    p.add_argument("action", choices=["prepare"])
    p.add_argument("--gguf", default=None, metavar="FILE",
                   help="a GGUF file of a supported family (llama, mistral/mixtral as llama, qwen2, qwen3, qwen3moe, "
                        "gemma2, gemma3, phi3), converted tensor by tensor")
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help=f"with --gguf: the weights' dtype (default {GGUF_DTYPE})")
    p.add_argument("--out", default=None, help="target directory (default: the LogicPipe cache)")
    p.add_argument("--force", action="store_true", help="convert again even if a finished conversion matches")
    p.set_defaults(fn=cmd_model)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        sys.exit(args.fn(args))
    except grpc.RpcError as exc:  # one line, the fix named where it is known (call_error)
        print(f"lpctl: {call_error(args, exc)}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except (MeshError, ModelError, TlsError) as exc:  # from local work: say it, no traceback
        print(f"lpctl: {exc}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        close_channels()


def cli() -> None:
    """The `lpctl` command: main, then the process ends at once with main's status, its output
    flushed (common.process.exit_after: left to the interpreter's shutdown, gRPC's finalisers hung
    now and then after a resumed stream; nothing of lpctl's needs them)."""
    exit_after(main)


if __name__ == "__main__":
    cli()
