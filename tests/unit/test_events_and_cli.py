"""Event fan-out by owner with bounded queues; lpctl refusing bad flags in one line."""
from __future__ import annotations

import asyncio
import subprocess
import sys

from logicpipe.stage_node.net import events as events_mod
from logicpipe.stage_node.net.events import EventHub
from logicpipe.v1 import stage_pb2


def test_events_reach_only_their_owner_and_a_slow_subscriber_is_cut_off(monkeypatch):
    monkeypatch.setattr(events_mod, "MAX_QUEUED_BATCHES", 3)

    async def main():
        hub = EventHub()
        mine, other, slow = hub.subscribe("a"), hub.subscribe("b"), hub.subscribe("a")
        ev = [stage_pb2.Event(session_id="s1")]
        hub.emit("a", ev)
        assert (await mine.next_batch()) == ev and other.queue.empty()
        for _ in range(3):
            hub.emit("a", ev)
            await mine.next_batch()  # `mine` keeps up, `slow` never reads
        assert slow.overflowed and not mine.overflowed
        assert hub.listening("a") and hub.subscribers == 2  # the slow one is gone
        hub.unsubscribe(mine)
        hub.unsubscribe(other)
        assert not hub.listening("a") and hub.left_at("a") is not None and hub.subscribers == 0

    asyncio.run(main())


def test_lpctl_refuses_bad_flags_in_one_line_without_a_traceback():
    for args in (["--max-tokens", "-1"], ["--max-tokens", "abc"], ["--temperature", "inf"]):
        out = subprocess.run([sys.executable, "-m", "logicpipe.controller.cli.lpctl", "--controller", "127.0.0.1:1", "submit",
                              "hi",
                              *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (args, out.stderr)
        assert "Traceback" not in out.stderr and out.stderr.strip(), (args, out.stderr)
        assert len(out.stderr.strip().splitlines()[-1]) < 300


def test_lpctl_chat_refuses_a_bad_temperature_in_one_line():
    for args in (["--temperature", "-1"], ["--top-p", "0"]):
        out = subprocess.run([sys.executable, "-m", "logicpipe.controller.cli.lpctl", "--controller", "127.0.0.1:1", "chat",
                              *args], input="hi\n", capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (args, out.stderr)
        assert "Traceback" not in out.stderr and out.stderr.strip().splitlines() == [
            line for line in out.stderr.strip().splitlines() if line.startswith("lpctl: ")], (args, out.stderr)
        assert ("temperature" if args[0] == "--temperature" else "top_p") in out.stderr


# --- lpctl nodes / status formatting ------------------------------------------------------------

REFUSED = ("stage node 10.0.0.13:50061 is unreachable: failed to connect to all addresses; last error: UNKNOWN: "
           "ipv4:10.0.0.13:50061: Failed to connect to remote host: connect: Connection refused (111)")
TLS_FAILED = ("stage node 10.0.0.14:50061 is unreachable: failed to connect to all addresses; last error: UNKNOWN: "
              "ipv4:10.0.0.14:50061: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:"
              "SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER: Invalid certificate verification context: OK")


def mesh_status(draining: bool = False):
    """A controller's Status: node a serves layers 0-29; b was drained after serving 15-29 (its own
    Status still says so), and while `draining` the plan in force still has it; c and d do not answer."""
    from logicpipe.v1 import controller_pb2

    def node_status(node_id, start, end):
        s = stage_pb2.StatusReply(node_id=node_id, state="ready", device="cpu", start_layer=start, end_layer=end,
                                  weight_format="float32", open_sessions=2)
        s.profile.flops, s.profile.memory_bytes = 50e9, 8 * 2**30
        s.profile.weight_formats.extend(["float32"])
        return s

    st = controller_pb2.ControllerStatusReply(state="ready", plan_id="p1", plan_generation=7, model_dir="/m")
    st.stages.add(node_id="a", address="10.0.0.11:50061", start_layer=0, end_layer=15, device="cpu")
    if draining:
        st.stages.add(node_id="b", address="10.0.0.12:50061", start_layer=15, end_layer=30, device="cpu")
    st.nodes.add(address="10.0.0.11:50061", node_id="a", source="mdns", reachable=True, in_plan=True,
                 status=node_status("a", 0, 15))
    st.nodes.add(address="10.0.0.12:50061", node_id="b", source="mdns", reachable=True, in_plan=draining,
                 drained=True, down="drained", status=node_status("b", 15, 30))
    st.nodes.add(address="10.0.0.13:50061", node_id="c", source="registered", reachable=False, error=REFUSED)
    st.nodes.add(address="10.0.0.14:50061", source="static", reachable=False, error=TLS_FAILED)
    return st


def test_lpctl_nodes_shows_a_drained_node_without_its_old_layers_and_errors_in_one_short_line():
    from logicpipe.controller.cli.lpctl import ERROR_WIDTH, NODE_HEADER, _table, node_rows

    rows = {r[0]: dict(zip(NODE_HEADER, r)) for r in node_rows(mesh_status())}
    assert rows["10.0.0.11:50061"]["layers"] == "0-14" and rows["10.0.0.11:50061"]["use"] == "in plan"
    drained = rows["10.0.0.12:50061"]
    assert drained["layers"] == "drained" and drained["use"] == "drained"
    assert drained["format"] == "- (offers float32)"  # the format of its old assignment is gone too
    assert rows["10.0.0.13:50061"]["state"] == "unreachable"
    assert rows["10.0.0.13:50061"]["use"] == "Connection refused"
    assert rows["10.0.0.14:50061"]["use"] == "TLS handshake failed: WRONG_VERSION_NUMBER"
    table = _table(node_rows(mesh_status()), NODE_HEADER)
    assert "15-29" not in table and "failed to connect" not in table
    assert all(len(r[-1]) <= ERROR_WIDTH for r in node_rows(mesh_status())), table
    assert not any(line != line.rstrip() for line in table.splitlines())
    # --json keeps the whole error for scripts
    full = {r[0]: r[-1] for r in node_rows(mesh_status(), full_errors=True)}
    assert full["10.0.0.13:50061"] == REFUSED


def test_lpctl_status_lists_drained_and_unreachable_nodes_in_one_line_each():
    from logicpipe.controller.cli.lpctl import ERROR_WIDTH, status_lines

    lines = status_lines(mesh_status())
    assert lines[0] == "state ready  plan p1 (generation 7)  model /m"
    assert "node b (10.0.0.12:50061): drained" in lines
    assert "node c (10.0.0.13:50061): unreachable: Connection refused" in lines
    assert "node 10.0.0.14:50061: unreachable: TLS handshake failed: WRONG_VERSION_NUMBER" in lines
    assert not any("15-29" in line or "failed to connect" in line for line in lines), lines
    assert max(map(len, lines)) <= ERROR_WIDTH + 40, lines
    # while the drain moves its requests, the plan in force still has b: its stage row says so
    lines = status_lines(mesh_status(draining=True))
    row = next(line for line in lines if "10.0.0.12:50061" in line)
    assert row.split()[-1] == "draining" and "15-29" in row
    assert not any(line.startswith("node b") for line in lines)  # it is in the stage table


def test_short_error_keeps_the_reason():
    from logicpipe.controller.cli.lpctl import ERROR_WIDTH, short_error

    assert short_error("stage node x:1 is unreachable: no answer in time") == "no answer in time"
    assert short_error("errors resolving gone.invalid:50061: [field:hostname lookup error:address lookup failed "
                       "for gone.invalid:50061: Domain name not found]") == "name not resolved: Domain name not found"
    assert short_error("first line\nsecond line") == "first line"
    long = short_error("x" * 300)
    assert len(long) == ERROR_WIDTH and long.endswith("…")
    assert short_error("") == "unreachable"


def test_lpctl_status_and_nodes_show_each_pipeline_of_replicas():
    """Two pipelines: status lists them (stages, running, predicted tok/s) and numbers each stage
    within its own pipeline; nodes says which pipeline a node serves."""
    from logicpipe.controller.cli.lpctl import NODE_HEADER, node_rows, status_lines

    st = mesh_status()
    del st.stages[:]
    st.stages.add(node_id="a", address="10.0.0.11:50061", start_layer=0, end_layer=30, device="cpu", pipeline=0)
    st.stages.add(node_id="e", address="10.0.0.15:50061", start_layer=0, end_layer=12, device="cpu", pipeline=1)
    st.stages.add(node_id="f", address="10.0.0.16:50061", start_layer=12, end_layer=30, device="cpu", pipeline=1)
    st.pipelines.add(index=0, running=3, predicted_tokens_per_s=412.0, serving=True)
    st.pipelines.add(index=1, running=1, predicted_tokens_per_s=0.0, serving=False)
    st.nodes.add(address="10.0.0.15:50061", node_id="e", source="mdns", reachable=True, in_plan=True, pipeline=1)
    lines = status_lines(st)
    assert "pipelines: 2 (replicas; each request runs on one)" in lines
    assert "  pipeline 0: 1 stage, 3 running, 412 tok/s predicted" in lines
    assert "  pipeline 1: 2 stages, 1 running, not serving" in lines
    rows = [line.split() for line in lines if "10.0.0.1" in line and line.split()[0].isdigit()]
    assert [(r[0], r[1], r[2]) for r in rows] == [("0", "0", "a"), ("1", "0", "e"), ("1", "1", "f")]
    use = {r[0]: dict(zip(NODE_HEADER, r))["use"] for r in node_rows(st)}
    assert use["10.0.0.11:50061"] == "in plan (pipeline 0)" and use["10.0.0.15:50061"] == "in plan (pipeline 1)"
