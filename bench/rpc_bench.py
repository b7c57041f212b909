"""N nodes in network namespaces: the mesh against llama.cpp's RPC backend over the same links.

Each node is a network namespace joined to this one by a veth pair (tests/netns.py), optionally
capped both ways by a token bucket (`--rate 100mbit`: tc tbf, burst 32kbit, latency 50ms). Both
sides run their per-node work in the namespaces and their front in this namespace:

  mesh       a `logicpipe-stage --quantize int4 --threads T` per namespace, listening on its address,
             and a controller here (`--nodes` listing them, `--no-mdns`, a `--mesh` name of its own);
             requests through the controller's Submit (gRPC), as bench.engine_bench sends them.
  llama.cpp  a ggml RPC server per namespace (bench/ggml_rpc_server.py, T threads) and llama.cpp in
             this process with every layer on the servers, split by layer like the mesh's plan (the
             same decoder layers on the same node; the output layer on the last), the token
             embeddings here (llama.cpp keeps its input layer on the CPU), greedy (argmax here of the
             logits the last server sends back), T threads (bench/llamacpp_rpc.py).

The same token ids go to both: a chat prompt whose system message names its round (and request), so
that no prompt shares a KV block with an earlier one and both sides prefill it all (the mesh's prefix
cache would otherwise skip the prefill from the second round on). `--tokens` new tokens, no EOS stop;
rates are new tokens per second from the submit to the last token, prefill included (the time to the
first token is reported too); one warm-up, then `--rounds` rounds interleaved (llama.cpp, then the
mesh, each round) so that other load on the machine hits both alike; medians. With `--concurrency C`
(default 8; 1 skips it) each round also runs C requests at once: C concurrent Submits to the mesh,
and llama.cpp decoding the C sequences in one batch (its own multi-sequence KV), aggregate tokens per
second. Also measured: the CPU seconds of every process a
round (llama.cpp's servers against its client here: the servers must be the ones computing), the bytes
over the links a token, and how far the mesh's greedy tokens agree with llama.cpp's, round by round
(different 4-bit grids: reported, never failed on).

Prints one JSON object (both rates, mesh / llama.cpp, the nodes, the cap, the threads, the CPU, the
load average) and a one-line summary on stderr. Needs root (namespaces, tc) and llama-cpp-python
built with -DGGML_RPC=ON. Everything it starts or makes is stopped or removed at the end, also after
a failure or Ctrl-C.

    python -m bench.rpc_bench --nodes 3 --tokens 128 --rounds 3
    python -m bench.rpc_bench --nodes 3 --tokens 128 --rounds 3 --rate 100mbit
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import signal
import statistics
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.engine_bench import PROMPTS, cpu_description, submit
from bench.llamacpp_rpc import RpcLlama, RpcServers, proc_cpu_s
from tests.localmesh import LocalMesh, free_port
from tests.netns import Namespaces

STAGE_PORT = 50061  # each namespace has its own ports
RPC_PORT = 50052
RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)")
RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}  # tc's: decimal, bits
WARMUP_TOKENS = 16


def parse_rate(text: str) -> int:
    """Bits per second of a rate written as tc writes it, NUMBER + bit|kbit|mbit|gbit ("100mbit" ->
    100_000_000); tc is given it back as "<bits>bit"."""
    m = RATE.fullmatch(text.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"rate {text!r}: want a positive NUMBER followed by bit, kbit, mbit or gbit (e.g. 100mbit)")
    return int(float(m.group(1)) * RATE_UNITS[m.group(2)])


def agreement(a: list[int], b: list[int]) -> dict:
    """How far two greedy token streams agree: the common prefix and the positions equal."""
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"common_prefix": prefix, "equal_positions": sum(x == y for x, y in zip(a, b)), "of": min(len(a), len(b))}


def plan_order(mesh: LocalMesh) -> list[tuple[str, int]]:
    """(stage address, decoder layers) of the mesh's pipeline, in stage order."""
    stages = sorted((s for s in mesh.controller_status().stages if s.pipeline == 0), key=lambda s: s.start_layer)
    return [(s.address, s.end_layer - s.start_layer) for s in stages]


def start_mesh(mesh: LocalMesh, ns: Namespaces) -> None:
    """A stage per namespace on its address, and the controller here, on this namespace's address
    every namespace reaches (stages reach their controller for weights and leave)."""
    mesh.stage_addresses = [mesh.start_stage(i, f"{ns.address(name)}:{STAGE_PORT}", prefix=tuple(ns.prefix(name)))
                            for i, name in enumerate(ns.names)]
    mesh.controller_address = f"{ns.stage_host}:{free_port()}"
    mesh.start_controller()


def mesh_requests(address: str, prompts: list[list[int]], tokens: int) -> tuple[float, float, list[list[int]]]:
    """(wall seconds, seconds to the first token of any, new tokens of each) of the prompts submitted at
    once to the mesh."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: submit(address, ids=p, tokens=tokens), prompts))
    bad = [r["error"] or f"{len(r['ids'])} tokens" for r in results if r["error"] or len(r["ids"]) != tokens]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(prompts)} mesh requests failed: {bad[:2]}")
    return max(r["total_s"] for r in results), min(r["first_token_s"] for r in results), [r["ids"] for r in results]


class Meter:
    """How much named counters grew inside `with meter:`, one entry per use; medians over the uses."""

    def __init__(self, counters: dict[str, Callable[[], float]]):
        self.counters = counters
        self.uses: list[dict[str, float]] = []

    def _now(self) -> dict[str, float]:
        return {n: read() for n, read in self.counters.items()}

    def __enter__(self) -> Meter:
        self._t0 = self._now()
        return self

    def __exit__(self, *exc) -> None:
        self.uses.append({n: v - self._t0[n] for n, v in self._now().items()})

    def medians(self) -> dict[str, float]:
        return {n: round(statistics.median(u[n] for u in self.uses), 3) for n in self.uses[0]}


def this_process_cpu_s() -> float:
    here = os.times()
    return here.user + here.system


def counters(pids: dict[str, int], ns: Namespaces) -> dict[str, Callable[[], float]]:
    """CPU seconds of this process and of each named process, and the bytes over the namespaces' links
    (a packet from one namespace to another crosses, and counts on, two links)."""
    return {"cpu_s this process": this_process_cpu_s,
            **{f"cpu_s {n}": functools.partial(proc_cpu_s, pid) for n, pid in pids.items()},
            "link_bytes": ns.bytes_moved}


def round_prompts(args, model_dir: Path) -> list[dict[str, list[list[int]]]]:
    """The warm-up's prompts, then every round's, as token ids in the model's chat template: per mode,
    one stream and `--concurrency` requests at once. Each request's system message names its round and
    request, so that no prompt shares a KV block with another: the mesh's prefix cache would skip the
    prefill of a prompt it has seen, where llama.cpp here prefills every prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)

    def ids(tag: str, prompt: str) -> list[int]:
        system = f"{tag}. You are a helpful AI assistant named SmolLM, trained by Hugging Face"
        text = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": prompt}],
                                       tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    sizes = {"one_stream": 1, **({f"{args.concurrency}_concurrent": args.concurrency} if args.concurrency > 1 else {})}
    return [{mode: [ids(f"{name}, request {i + 1}", PROMPTS[i % len(PROMPTS)]) for i in range(n)]
             for mode, n in sizes.items()}
            for name in ["Warm-up", *(f"Round {r + 1}" for r in range(args.rounds))]]


def measure(args, rounds: list[dict[str, list[list[int]]]], ns: Namespaces, mesh: LocalMesh, llm: RpcLlama,
            servers: RpcServers, order: list[str]) -> dict:
    """The warm-up (`rounds[0]`), then the interleaved rounds: rates, times to the first token, CPU
    seconds and link bytes a round, agreement of the one stream."""
    pids = {"llamacpp": {f"rpc server {a.rsplit(':', 1)[0]}": p.pid for a, p in zip(order, servers.procs)},
            "mesh": {"controller": mesh.procs["controller"].pid,
                     **{f"stage {a.rsplit(':', 1)[0]}": mesh.procs[f"stage{mesh.stage_addresses.index(a)}"].pid
                        for a in order}}}
    modes = list(rounds[0])
    meters = {(side, mode): Meter(counters(pids[side], ns)) for side in pids for mode in modes}
    for prompts in rounds[0].values():  # warm-up: one-time costs (graphs, connections, allocators)
        llm.generate(prompts, WARMUP_TOKENS)
        mesh_requests(mesh.controller_address, prompts, WARMUP_TOKENS)
    rates = {mode: {"llamacpp": [], "mesh": []} for mode in modes}
    first = {mode: {"llamacpp": [], "mesh": []} for mode in modes}
    agree = []
    for r, round_ in enumerate(rounds[1:]):
        for mode, prompts in round_.items():
            with meters["llamacpp", mode]:
                wall, first_s, llm_out = llm.generate(prompts, args.tokens)
            rates[mode]["llamacpp"].append(len(prompts) * args.tokens / wall)
            first[mode]["llamacpp"].append(first_s)
            with meters["mesh", mode]:
                wall, first_s, mesh_out = mesh_requests(mesh.controller_address, prompts, args.tokens)
            rates[mode]["mesh"].append(len(prompts) * args.tokens / wall)
            first[mode]["mesh"].append(first_s)
            if mode == "one_stream":
                agree.append(agreement(mesh_out[0], llm_out[0]))
            print(f"round {r + 1}/{args.rounds}, {mode}: llama.cpp RPC {rates[mode]['llamacpp'][-1]:.1f} tok/s, "
                  f"mesh {rates[mode]['mesh'][-1]:.1f} tok/s", file=sys.stderr)
    out = {}
    for mode in modes:
        lt, mt = statistics.median(rates[mode]["llamacpp"]), statistics.median(rates[mode]["mesh"])
        out[mode] = {"llamacpp_tps": round(lt, 2), "mesh_tps": round(mt, 2), "ratio": round(mt / lt, 3),
                     "raw_tps": {side: [round(x, 2) for x in v] for side, v in rates[mode].items()},
                     "per_round": {side: meters[side, mode].medians() for side in pids}}
        if mode == "one_stream":  # (at once, the first token of one request or of all says little)
            out[mode]["first_token_s"] = {side: round(statistics.median(v), 3) for side, v in first[mode].items()}
        for side in pids:
            out[mode][f"{side}_link_bytes_per_token"] = round(
                out[mode]["per_round"][side]["link_bytes"] / (len(rounds[0][mode]) * args.tokens))
    out["agreement"] = agree  # of the one stream, round by round (different prompts)
    return out


def run(args) -> dict:
    from logicpipe.controller.cli.model_prep import find_default_gguf, prepare_default_model

    model_dir = prepare_default_model()
    gguf = find_default_gguf()
    names = [f"n{i}" for i in range(args.nodes)]
    bits = parse_rate(args.rate) if args.rate else None
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rpc-bench-") as work, \
            Namespaces(names, rate=f"{bits}bit" if bits else None) as ns, contextlib.ExitStack() as stack:
        # plaintext on the namespaces' addresses (--insecure): a bench's private links, as llama.cpp's RPC is
        mesh = LocalMesh(args.nodes, model_dir, Path(work) / "mesh", threads=args.threads,
                         stage_args=("--quantize", "int4", "--insecure"),
                         controller_args=("--mesh", f"rpc-bench-{os.getpid()}", "--insecure"))
        stack.callback(mesh.stop)
        start_mesh(mesh, ns)
        plan = plan_order(mesh)
        if len(plan) != args.nodes:
            raise RuntimeError(f"the mesh planned {len(plan)} stages over {args.nodes} nodes: {plan}")
        order = [a for a, _ in plan]  # llama.cpp's devices in the mesh's stage order, same layers
        host_of = {f"{ns.address(n)}:{STAGE_PORT}": ns.address(n) for n in names}
        prefix_of = {f"{ns.address(n)}:{STAGE_PORT}": ns.prefix(n) for n in names}
        endpoints = [f"{host_of[a]}:{RPC_PORT}" for a in order]
        servers = stack.enter_context(RpcServers(endpoints, [prefix_of[a] for a in order], args.threads, Path(work)))
        layers = [n for _, n in plan]
        rounds = round_prompts(args, model_dir)
        longest = max(len(p) for round_ in rounds for prompts in round_.values() for p in prompts)
        llm = RpcLlama(gguf, endpoints, layers, args.threads, seq_tokens=longest + args.tokens)
        stack.callback(llm.close)
        placement = llm.placement()
        if list(placement.values()) != [*layers[:-1], layers[-1] + 1]:  # the last device: the output layer too
            raise RuntimeError(f"llama.cpp placed the layers {placement}, not as the mesh's plan {layers}")
        results = measure(args, rounds, ns, mesh, llm, servers, order)
    return {
        "nodes": args.nodes, "rate": args.rate, "rate_bits_per_s": bits,
        "threads": args.threads, "tokens": args.tokens, "rounds": args.rounds, "concurrency": args.concurrency,
        "cpu": cpu_description(), "load_average": {"before": load_before, "after": os.getloadavg()},
        "model": {"gguf": gguf.name, "mesh": f"{model_dir.name}, --quantize int4"},
        "split": {"decoder_layers": layers, "output_layer": "last node",
                  "llamacpp_tensor_split": llm.split, "llamacpp_placement": placement},
        **results,
    }


def summary(res: dict) -> str:
    one = res["one_stream"]
    line = (f"rpc_bench: {res['nodes']} nodes, {res['rate'] or 'uncapped'}, {res['threads']} thread(s): one stream "
            f"mesh {one['mesh_tps']:.1f} tok/s, llama.cpp RPC {one['llamacpp_tps']:.1f} tok/s, mesh/llama.cpp "
            f"{one['ratio']:.2f}")
    conc = f"{res['concurrency']}_concurrent"
    if conc in res:
        c = res[conc]
        line += f"; {res['concurrency']} concurrent {c['mesh_tps']:.1f} vs {c['llamacpp_tps']:.1f} ({c['ratio']:.2f})"
    return line + f"; load {res['load_average']['after'][0]:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3, help="network namespaces, one node of each side in each")
    ap.add_argument("--rate", default=None, help="cap every node's link to this tc rate both ways, e.g. 100mbit "
                                                 "(default: uncapped)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads of every stage, every RPC server and the llama.cpp client")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds after one warm-up; medians")
    ap.add_argument("--concurrency", type=int, default=8, help="requests at once in the second mode (1: skip it)")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = ap.parse_args()
    if args.rate:
        try:
            parse_rate(args.rate)  # fails before anything is made
        except ValueError as exc:
            ap.error(str(exc))
    if args.nodes < 1 or args.rounds < 1 or args.tokens < 1:
        ap.error("--nodes, --rounds and --tokens must be at least 1")
    if os.geteuid() != 0:
        raise SystemExit("rpc_bench needs root: it makes network namespaces (ip netns) and caps links (tc)")
    # a SIGTERM (a timeout) must still stop the processes and remove the namespaces: by default it
    # ends Python without running the `with` exits
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res = run(args)
    print(json.dumps(res, indent=2))
    print(summary(res), file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
