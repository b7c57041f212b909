"""`logicpipe-controller`: plan the mesh, assign the stages, serve requests."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from pathlib import Path

from logicpipe.common.discovery import discovery_interface
from logicpipe.common.health import add_health
from logicpipe.common.modeldir import ModelError
from logicpipe.common.process import (
    CONTROLLER_PORT,
    STAGE_PORT,
    address_flag,
    address_list_flag,
    bind,
    cannot_listen,
    check_free,
    exit_after,
    run_main,
    serve_until_signalled,
    with_port,
)
from logicpipe.common.security.bundle import TlsError, check_name
from logicpipe.common.security.revocations import Revocations
from logicpipe.common.transport import PLAINTEXT, add_flags, from_flags
from logicpipe.controller.app import ControllerApp, ControllerOptions
from logicpipe.controller.cli.gguf_convert import DTYPES
from logicpipe.controller.api.http_api import start_http
from logicpipe.controller.api.http_auth import ApiKeys, KeyFileError, check_exposure
from logicpipe.controller.mesh.join import JoinAuthority
from logicpipe.controller.jobs.journal import Journal, JournalError
from logicpipe.controller.jobs.journal_files import prepare as prepare_state_dir
from logicpipe.controller.cli.model_prep import GGUF_DTYPE, resolve_model
from logicpipe.controller.mesh.planning import check_groups, replicas_flag, tp_group_flag, tp_hosts_flag
from logicpipe.controller.jobs.door import DEFAULT_REQUESTS_PER_CLIENT, FrontDoor
from logicpipe.controller.jobs.scheduler import DEFAULT_SPECULATE, MAX_SPECULATE
from logicpipe.controller.api.service import ControllerServicer, JoinServicer
from logicpipe.formats import FLOAT_DTYPES
from logicpipe.planner.disagg import MODES as DISAGG_MODES
from logicpipe.controller.jobs.standby import STAGE_LEASE_S, Standby, read_peer_secret
from logicpipe.policy import CONTROLLER_POLICY
from logicpipe.v1 import controller_pb2_grpc

log = logging.getLogger("logicpipe.controller")

PROG = "logicpipe-controller"

SERVICE_NAME = "logicpipe.v1.Controller"
STARTED = time.monotonic()  # about when this process started (its predecessor was gone by then)
DEFAULT_CONTEXT = 2048  # --context: tokens per sequence the plan reserves KV for (clamped to the model's limit)
EXIT_FENCED = 75  # another controller took over: stopped, to be started again (as its standby) by systemd


def default_state_dir(listen: str) -> Path:
    """$STATE_DIRECTORY/controller-PORT under systemd, else $XDG_STATE_HOME (~/.local/state)/logicpipe/...:
    one per port, so two controllers on one host never share a journal."""
    port = listen.rpartition(":")[2] or str(CONTROLLER_PORT)
    base = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if not base:
        base = os.path.join(os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state"),
                            "logicpipe")
    return Path(base) / f"controller-{port}"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description="Run the LogicPipe controller.")
    ap.add_argument("--listen", default=f"127.0.0.1:{CONTROLLER_PORT}", type=address_flag(CONTROLLER_PORT),
                    help="HOST:PORT to serve on (default %(default)s; a HOST alone means port "
                         f"{CONTROLLER_PORT})")
    ap.add_argument("--nodes", default="", type=address_list_flag(STAGE_PORT),
                    help="stage nodes to use besides those found by mDNS, HOST:PORT,... (networks without multicast; "
                         f"a HOST alone means port {STAGE_PORT})")
    ap.add_argument("--mdns-interface", default=None, metavar="ADDR",
                    help="browse mDNS on the interface with this address only (e.g. 127.0.0.1)")
    ap.add_argument("--mesh", default="default",
                    help="the mesh to use the nodes of (nodes and controllers of one mesh share its name; default %(default)s)")
    ap.add_argument("--no-mdns", action="store_true", help="do not look for stage nodes by mDNS")
    ap.add_argument("--advertise", default=None, metavar="HOST:PORT",
                    help="the address stages reach this controller at (weights, leave); default: --listen, "
                         "a wildcard host meaning the address a stage sees the controller call from")
    ap.add_argument("--settle-s", type=float, default=2.0,
                    help="the first plan waits this long after the first node for others (default %(default)s)")
    ap.add_argument("--replan-gain", type=float, default=0.10,
                    help="a joining node re-plans only when the new plan's step cost is lower by this fraction "
                         "(default %(default)s)")
    ap.add_argument("--wait-for-nodes-s", type=float, default=60.0,
                    help="with no plan that fits the nodes there are, a request waits this long for one "
                         "(default %(default)s)")
    ap.add_argument("--model", default=None, metavar="DIR|FILE.gguf",
                    help="a safetensors model directory of a supported family (Llama, Mistral, Mixtral, Qwen2/2.5, "
                         "Qwen3, Qwen3-MoE, Gemma 2/3, Phi-3), or a GGUF file of one, converted once into the cache "
                         "(default: the embedded SmolLM2-135M-Instruct, converted on first use)")
    ap.add_argument("--gguf-dtype", default=GGUF_DTYPE, choices=list(DTYPES),
                    help="with --model FILE.gguf: the dtype its weights are converted to (default %(default)s)")
    ap.add_argument("--plan", default=None, help="plan artifact (JSON) to reuse when it still matches, and to "
                                                 "write the plan in force to")
    ap.add_argument("--strategy", default="dp", help="partition strategy: dp | uniform | memory | compute | mixed")
    ap.add_argument("--objective", default="throughput", choices=["throughput", "latency"])
    ap.add_argument("--replicas", default="auto", type=replicas_flag, metavar="auto|N",
                    help="pipelines (replicas over disjoint nodes) at most: auto (default) lets the planner choose how "
                         "many by predicted tokens/s at the traffic it sees; N caps them; 1 is one pipeline over the "
                         "nodes, planned by its bottleneck stage as before replicas")
    ap.add_argument("--tp-group", default=(), type=tp_group_flag, metavar="A,B[;C,D]",
                    help="join stage nodes (node ids) into one tensor-parallel stage over gloo on TCP (CPU nodes on a "
                         "fast LAN): each group is one stage of the plan whose rank 0, the node the mesh talks to, "
                         "is the first; the others compute their share of its layers and serve nothing else. A "
                         "group forms while all its nodes are usable (else they are planned one by one); its width "
                         "must divide the model's heads, KV heads, MLP and vocabulary (default: none)")
    ap.add_argument("--tp-hosts", default=False, type=tp_hosts_flag, metavar="auto|off",
                    help="auto: the planner itself joins pairs of one-device nodes of one kind on different hosts "
                         "(besides --tp-group's) into tensor-parallel stages where that shortens the one-stream "
                         "step by more than 10%% (its all-reduce a ring over their measured link); off (default): "
                         "only --tp-group's")
    ap.add_argument("--disaggregate", default="auto", choices=list(DISAGG_MODES),
                    help="with several pipelines, prefill a prompt on one and decode it on another (its KV handed "
                         "over stage to stage): auto (default) when one pipeline's measured prefill rate is 4x "
                         "every other's and the handoff brings the first token sooner; on: the fastest prefiller "
                         "prefills every prompt for the others; off: never")
    ap.add_argument("--kv-mirror", default="on", choices=["on", "off"],
                    help="with several pipelines of the same kind (replicas), each pipeline's stages copy the full "
                         "KV blocks of their running sequences to the next two pipelines' stages as they fill, so a "
                         "request that a fault moves to one of those computes only its last few tokens again, not "
                         "its whole history (default on; float KV only)")
    ap.add_argument("--context", type=int, default=None, metavar="TOKENS",
                    help="tokens of context per sequence the plan reserves KV for, up to the model's limit "
                         "(max_position_embeddings: 8192 for the default model; 131072 for a Llama-3.1 with its "
                         "llama3 RoPE scaling); a prompt longer than it still runs where the stages' KV holds it "
                         "(default 2048, or the model's limit where that is less)")
    ap.add_argument("--dtype", default="float32", choices=list(FLOAT_DTYPES),
                    help="compute dtype on the stages (a stage whose device lacks it computes in float32: the plan "
                         "says which, stage by stage)")
    ap.add_argument("--micro-batches", type=int, default=0,
                    help="micro-batches in flight through the pipeline (default 0: one per distinct compute "
                         "device, so stages sharing one machine's cores batch together)")
    ap.add_argument("--speculate", type=int, default=DEFAULT_SPECULATE, metavar="K",
                    help="candidate tokens drafted per step at most, by prompt lookup, verified in the same pass "
                         "(a request may say otherwise; 0 = off; default %(default)s)")
    ap.add_argument("--prefill-chunk", type=int, default=0, metavar="TOKENS",
                    help="prompt tokens per step, so a long prompt flows through the stages in chunks "
                         "(default 0: the chunk the planner's cost model finds fastest)")
    ap.add_argument("--max-requests-per-client", type=int, default=DEFAULT_REQUESTS_PER_CLIENT, metavar="N",
                    help="requests one client (certificate, or host without TLS) may have running at once; more get "
                         "RESOURCE_EXHAUSTED (default %(default)s)")
    ap.add_argument("--http", default=None, metavar="HOST:PORT", type=address_flag(None),
                    help="also serve an OpenAI-compatible HTTP API here (/v1/chat/completions, /v1/completions, "
                         "/v1/models, /health, /metrics; off by default); off loopback it needs --http-token-file "
                         "(or --insecure)")
    ap.add_argument("--http-token-file", default="", metavar="FILE",
                    help="API keys of the HTTP API, one `NAME TOKEN` (or `TOKEN`) a line: every /v1/* request needs "
                         "`Authorization: Bearer TOKEN`, and --max-requests-per-client caps each key")
    ap.add_argument("--ca-dir", default="", metavar="DIR",
                    help="the mesh CA (ca.key, ca.crt from `lpctl ca init`): lets the controller issue join tokens "
                         "(`lpctl token create`) and revoke nodes (`lpctl revoke`); revoked names are kept there")
    ap.add_argument("--state-dir", default=None, metavar="DIR",
                    help="where the request journal lives (every admitted request, so that a restarted controller "
                         "resumes them; default $STATE_DIRECTORY or ~/.local/state/logicpipe, controller-PORT); "
                         "while it cannot be written (full, read-only) new requests are refused, and a journal found "
                         "damaged at start is moved aside to journal.damaged-TIME/ and reported by `lpctl status`")
    ap.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                    type=address_list_flag(CONTROLLER_PORT),
                    help="another controller of this mesh (repeat, or comma-separate; a HOST alone means port "
                         f"{CONTROLLER_PORT}): the one that finds no active peer at start is active, the other its "
                         "standby, which copies its journal and takes over within seconds when it dies")
    ap.add_argument("--standby-name", default="", metavar="NAME",
                    help="with --peer over TLS: the certificate name of the standby controller, the only party "
                         "Replicate streams this controller's journal (every running prompt) to; default: nobody")
    ap.add_argument("--peer-secret-file", default="", metavar="FILE",
                    help="with --peer in plaintext: a file holding a secret (e.g. `openssl rand -hex 32`), the same "
                         "on both controllers; the standby sends it, and Replicate streams the journal only to a "
                         "caller that does; default: nobody")
    ap.add_argument("--readmit", action="store_true",
                    help="an operator's act after this controller's journal (--state-dir) was lost: take the "
                         "fencing epoch from the --nodes' Status (their highest + 1), so the stages that refuse "
                         "an epoch-1 controller take this one again once the old one's lease expired")
    ap.add_argument("--join-listen", default=None, metavar="HOST:PORT", type=address_flag(None),
                    help="with --ca-dir: serve joining nodes here (plaintext; only Join, each call authenticated by "
                         "a one-time token's HMAC)")
    add_flags(ap, "controller")
    ap.add_argument("--log-level", default="INFO", help="INFO (default), DEBUG (also the traceback of an error that "
                                                        "stops the start), WARNING, ...")
    args = ap.parse_args(argv)
    if not 0 <= args.speculate <= MAX_SPECULATE:
        ap.error(f"--speculate must be 0 (off) to {MAX_SPECULATE}")
    if args.context is not None and args.context < 1:
        ap.error(f"--context must be a number of tokens >= 1, not {args.context}")
    if args.prefill_chunk < 0:
        ap.error("--prefill-chunk must be 0 (from the cost model) or a number of tokens")
    args.http_keys = None  # the HTTP API's keys, checked before anything starts
    if args.http_token_file and not args.http:
        ap.error("--http-token-file is for the HTTP API: give --http HOST:PORT too")
    if args.http and (why := check_exposure(args.http, args.http_token_file, args.insecure)):
        ap.error(why)
    if args.http_token_file:
        try:
            args.http_keys = ApiKeys.load(args.http_token_file)
        except KeyFileError as exc:
            ap.error(str(exc))
    return args


def listen_flags(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, address) of every port this controller would listen on."""
    return [(flag, value) for flag, value in (("--listen", args.listen), ("--join-listen", args.join_listen),
                                              ("--http", args.http)) if value]


def load_model(args: argparse.Namespace) -> Path:
    """The model directory to serve (model_prep.resolve_model), checked; SystemExit naming the fix."""
    try:
        return resolve_model(args.model, dtype=args.gguf_dtype, progress=log.info)
    except ModelError as exc:
        if args.model is None:
            raise SystemExit(f"no --model given: {exc}; or serve a model directory with --model DIR") from None
        raise SystemExit(f"--model {args.model}: {exc}") from None


async def serve(args: argparse.Namespace) -> None:
    for flag, address in listen_flags(args):  # before a model is converted or loaded: a taken port says so at once
        check_free(address, flag, PROG)
    state_dir = Path(args.state_dir) if args.state_dir else default_state_dir(args.listen)
    try:  # the same: a state directory that cannot hold the journal says so before the model loads
        await asyncio.to_thread(prepare_state_dir, state_dir)
    except JournalError as exc:
        raise SystemExit(f"--state-dir: {exc}") from None
    model_dir = await asyncio.to_thread(load_model, args)
    authority = None
    try:
        transport = from_flags(args.tls_dir, args.insecure, args.listen, "controller", log)
        args.mdns_interface = discovery_interface(args.mdns_interface, args.listen, transport.tls)
        if args.join_listen and not args.ca_dir:
            raise TlsError("--join-listen needs --ca-dir (the CA that signs the joining nodes' certificates)")
        # one list: the server refuses these names, the planner leaves them out, joins never sign them
        revocations = Revocations.in_ca_dir(args.ca_dir) if args.ca_dir else Revocations()
        if args.ca_dir:
            authority = JoinAuthority(args.ca_dir, revocations)
    except TlsError as exc:
        raise SystemExit(str(exc)) from None
    server = transport.server(CONTROLLER_POLICY, revocations)
    bound = bind(transport, server, args.listen, "--listen", PROG)
    join_server = None
    if args.join_listen:
        join_server = PLAINTEXT.server()  # a join is authenticated by its token's HMAC, not TLS
        controller_pb2_grpc.add_ControllerServicer_to_server(JoinServicer(authority), join_server)
        bind(PLAINTEXT, join_server, args.join_listen, "--join-listen", PROG)
    host = args.listen.rpartition(":")[0]
    try:  # the port a stage dials when --advertise names none: the one listened on
        address = with_port(args.advertise, bound, "--advertise") if args.advertise else f"{host}:{bound}"
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    try:
        peer_secret = read_peer_secret(args.peer_secret_file) if args.peer_secret_file else b""
    except ValueError as exc:
        raise SystemExit(f"--peer-secret-file: {exc}") from None
    if args.standby_name:
        try:
            check_name(args.standby_name)
        except TlsError as exc:
            raise SystemExit(f"--standby-name: {exc}") from None
    options = ControllerOptions(
        dtype=args.dtype, plan_path=args.plan, strategy=args.strategy, objective=args.objective,
        context=args.context or DEFAULT_CONTEXT,
        micro_batches=args.micro_batches, address=address, settle_s=args.settle_s,
        replan_gain=args.replan_gain, wait_for_nodes_s=args.wait_for_nodes_s, mdns=not args.no_mdns, mesh=args.mesh,
        speculate=args.speculate, prefill_chunk=args.prefill_chunk, replicas=args.replicas,
        disaggregate=args.disaggregate, kv_mirror=args.kv_mirror == "on", tp_groups=args.tp_group,
        tp_hosts=args.tp_hosts,
        standby_name=args.standby_name, peer_secret=peer_secret)
    journal = Journal(state_dir)
    try:
        app = ControllerApp(model_dir, args.nodes, transport=transport, revocations=revocations, options=options,
                            journal=journal)
    except (ModelError, OSError) as exc:  # a tokenizer that does not load is an OSError of transformers
        raise SystemExit(f"--model {args.model or model_dir}: {exc}") from None
    if args.context is not None and args.context > app.config.max_position_embeddings:  # the default is clamped
        raise SystemExit(f"--context {args.context}: over the model's limit of {app.config.max_position_embeddings} "
                         f"tokens (max_position_embeddings of {model_dir / 'config.json'}); give at most that")
    try:
        check_groups(args.tp_group, app.spec)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    try:  # (its files are read and checked: disk work, off the loop)
        await asyncio.to_thread(journal.open, app.digest)
    except JournalError as exc:
        raise SystemExit(f"--state-dir: {exc}") from None
    app.on_step_down.append(lambda: os.kill(os.getpid(), signal.SIGTERM))
    if authority is not None:
        authority.taken = app.commands.name_taken  # a join never gets a name a node or this controller goes by
    peers = [p for arg in args.peer for p in arg]
    door = FrontDoor(app.scheduler, app.tokenizer, model_dir=app.model_dir,
                     requests_per_client=args.max_requests_per_client, serving=app.not_serving)
    if args.readmit:
        if peers:
            raise SystemExit("--readmit: not with --peer (a standby takes its epoch from the active's journal)")
        try:
            await app.readmit()
        except ValueError as exc:
            raise SystemExit(f"--readmit: {exc}") from None
    if not peers:  # the journal's requests are there before the first client can ask to resume one
        app.take_journal()
    else:  # a standby until it finds no active peer (Standby.run): it takes no request before that
        app.role = "standby"
    controller_pb2_grpc.add_ControllerServicer_to_server(ControllerServicer(app, door, transport, authority), server)
    health = await add_health(server, SERVICE_NAME)

    takeover: asyncio.Task | None = None

    async def follow_then_take_over() -> None:
        nodes = await Standby(app, peers, transport, options.address, peer_secret).run()
        await app.start(mdns_interface=args.mdns_interface, nodes=nodes)

    async def ready() -> str:
        nonlocal takeover
        if peers:  # the standby until no peer answers as the active one (at once when none does)
            takeover = asyncio.create_task(follow_then_take_over(), name="standby")
            return f"standby of {', '.join(peers)} (active once none of them is)"
        left = STAGE_LEASE_S + 0.3 - (time.monotonic() - STARTED)
        if app.journal.epoch > 1 and app.journal.take_released() == app.journal.epoch - 1:
            log.info("the previous controller released every stage as it stopped: no lease to wait for")
        elif app.journal.epoch > 1 and left > 0:  # the stages' lease of our predecessor on this journal runs out first
            log.info("waiting %.1f s for the stages' lease of the previous controller to expire", left)
            await asyncio.sleep(left)
        await app.start(mdns_interface=args.mdns_interface)
        where = "by mDNS" + (f" on {args.mdns_interface}" if args.mdns_interface else "") if not args.no_mdns else ""
        listed = f"{len(args.nodes)} listed" if args.nodes else ""
        return f"serving; looking for stage nodes ({', '.join(x for x in (listed, where) if x) or 'Register'})"

    http = None
    try:  # from here every server started is stopped again, however the start ends
        if join_server is not None:
            await join_server.start()
            log.info("joining nodes served on %s (a join token authenticates each)", args.join_listen)
        await server.start()
        log.info("controller listening on %s:%d; model %s", host, bound, app.model_dir)
        if args.http:
            try:
                http = await start_http(app, door, args.http, args.http_keys)
            except OSError as exc:
                raise SystemExit(cannot_listen(args.http, "--http", PROG, exc)) from None
        await serve_until_signalled(server, health, SERVICE_NAME, grace_s=5.0, ready=ready,
                                    on_stop=app.scheduler.suspend)
    finally:
        if takeover is not None:
            takeover.cancel()
        if http is not None:
            await http.cleanup()
        await app.close()
        if join_server is not None:
            await join_server.stop(1.0)
        await server.stop(0)  # stopped already when serve_until_signalled returned
    if app.fenced:
        raise SystemExit(EXIT_FENCED)


def main(argv=None) -> None:
    args = parse_args(argv)
    run_main(PROG, lambda: serve(args), args.log_level)



def cli() -> None:
    """The command (console script and `python -m`): main, then the process ends at once with its
    status (common.process.exit_after: the interpreter's teardown costs seconds, nothing needs it)."""
    exit_after(main)


if __name__ == "__main__":
    cli()
