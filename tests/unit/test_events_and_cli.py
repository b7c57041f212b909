"""Event fan-out by owner with bounded queues; lpctl refusing bad flags in one line."""
from __future__ import annotations

import asyncio
import subprocess
import sys

from logicpipe.stage_node import events as events_mod
from logicpipe.stage_node.events import EventHub
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
        out = subprocess.run([sys.executable, "-m", "logicpipe.controller.lpctl", "--controller", "127.0.0.1:1", "submit",
                              "hi",
                              *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (args, out.stderr)
        assert "Traceback" not in out.stderr and out.stderr.strip(), (args, out.stderr)
        assert len(out.stderr.strip().splitlines()[-1]) < 300


def test_lpctl_chat_refuses_a_bad_temperature_in_one_line():
    for args in (["--temperature", "-1"], ["--top-p", "0"]):
        out = subprocess.run([sys.executable, "-m", "logicpipe.controller.lpctl", "--controller", "127.0.0.1:1", "chat",
                              *args], input="hi\n", capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (args, out.stderr)
        assert "Traceback" not in out.stderr and out.stderr.strip().splitlines() == [
            line for line in out.stderr.strip().splitlines() if line.startswith("lpctl: ")], (args, out.stderr)
        assert ("temperature" if args[0] == "--temperature" else "top_p") in out.stderr
