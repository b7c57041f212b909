"""Network namespaces a test makes for itself (needs root): one per controller, each joined to this
namespace by a veth pair, so that a controller can be cut off (`partition`) and joined again (`heal`)
while the stages, listening on an address this namespace's loopback takes on (`stage_host`), stay reachable
from every namespace that is not cut off. Everything made is removed on exit, also after a failure.
With `rate` (tc's form, "100mbit") every veth pair is capped to that rate both ways by a token bucket
(tbf) on each of its ends, as on a LAN of that speed (bench.rpc_bench runs nodes in the namespaces).

    with Namespaces(["a", "b"]) as ns:
        ns.prefix("a")       # the command prefix that runs a process in namespace a
        ns.address("a")      # its address, reachable from here and from namespace b
        ns.partition("a")    # a reaches nothing and nothing reaches it
"""
from __future__ import annotations

import contextlib
import os
import random
import subprocess
from pathlib import Path

FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


def available() -> bool:
    """Whether this process may make network namespaces (root, with `ip`)."""
    return os.geteuid() == 0 and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


def ip(*args: str, ns: str | None = None, tool: str = "ip") -> None:
    """Run `tool args` (ip, or tc) here or in namespace `ns`; raises with its error output."""
    cmd = [*(["ip", "netns", "exec", ns] if ns else []), tool, *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")


# the token bucket of a capped link: burst and queueing bound as in tc-tbf(8)'s examples for a LAN
TBF_BURST = "32kbit"
TBF_LATENCY = "50ms"


class Namespaces:
    def __init__(self, names: list[str], rate: str | None = None):
        self.names = list(names)
        self.rate = rate  # tc rate of every link, both ways ("100mbit"); None: uncapped
        self.tag = f"{random.randrange(16**4):04x}"  # interface names of 15 characters at most
        self.net = random.randrange(200, 250)        # 10.<net>.0.0/16: the stages' 10.<net>.0.1, ns i's 10.<net>.<i+1>.2
        self._made: list[tuple[str, str]] = []
        self._forward = ""

    def ns(self, name: str) -> str:
        return f"lp{self.tag}{name}"

    def _link(self, name: str) -> str:  # this namespace's end of name's veth pair
        return f"lpv{self.tag}{self.names.index(name)}"

    @property
    def stage_host(self) -> str:
        """This namespace's address that every namespace reaches (its loopback takes it on)."""
        return f"10.{self.net}.0.1"

    def address(self, name: str) -> str:
        return f"10.{self.net}.{self.names.index(name) + 1}.2"

    def prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(name)]

    def bytes_moved(self) -> int:
        """Bytes sent both ways over every namespace's link so far (the counters of this namespace's ends)."""
        stats = [Path(f"/sys/class/net/{self._link(n)}/statistics/{d}_bytes") for n in self.names for d in ("rx", "tx")]
        return sum(int(p.read_text()) for p in stats)

    def partition(self, name: str) -> None:
        ip("link", "set", self._link(name), "down")

    def heal(self, name: str) -> None:
        ip("link", "set", self._link(name), "up")

    def __enter__(self) -> "Namespaces":
        try:
            self._forward = FORWARD.read_text().strip()
            FORWARD.write_text("1")  # namespace to namespace goes through this one
            ip("addr", "add", f"{self.stage_host}/32", "dev", "lo")
            self._made.append(("addr", f"{self.stage_host}/32"))
            for i, name in enumerate(self.names):
                ns, here, there = self.ns(name), self._link(name), f"lpp{self.tag}{i}"
                ip("netns", "add", ns)
                self._made.append(("netns", ns))
                ip("link", "add", here, "type", "veth", "peer", "name", there)
                self._made.append(("link", here))
                ip("link", "set", there, "netns", ns)
                ip("addr", "add", f"10.{self.net}.{i + 1}.1/24", "dev", here)
                ip("link", "set", here, "up")
                ip("addr", "add", f"{self.address(name)}/24", "dev", there, ns=ns)
                ip("link", "set", there, "up", ns=ns)
                ip("link", "set", "lo", "up", ns=ns)
                ip("route", "add", "default", "via", f"10.{self.net}.{i + 1}.1", ns=ns)
                if self.rate:  # the qdiscs go with the links
                    cap = ("qdisc", "add", "dev")
                    tbf = ("root", "tbf", "rate", self.rate, "burst", TBF_BURST, "latency", TBF_LATENCY)
                    ip(*cap, here, *tbf, tool="tc")
                    ip(*cap, there, *tbf, tool="tc", ns=ns)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for kind, what in reversed(self._made):
            with contextlib.suppress(RuntimeError):
                if kind == "addr":
                    ip("addr", "del", what, "dev", "lo")
                else:
                    ip(kind, "del", what)
        self._made.clear()
        if self._forward:
            FORWARD.write_text(self._forward)
