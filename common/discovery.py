"""Stage nodes found by mDNS (DNS-SD): a node advertises itself, a controller browses.

Each node is one `_logicpipe._tcp.local.` service: its instance name comes from the node id, SRV/A
say where to dial, and the TXT record holds only small fields (`id`, `proto`, `digest`, `mesh`); the profile
itself is fetched over gRPC. Built on python-zeroconf's asyncio API; callbacks run on the caller's
event loop.

Three things make this work with several processes on one host, 127.0.0.1 included (Linux):
- `interfaces=["127.0.0.1"]` is enough for loopback; zeroconf then picks IPv4 only. `lo` has no
  MULTICAST flag, but a socket that sets IP_MULTICAST_IF to 127.0.0.1 and joins 224.0.0.251 there
  still gets its own and its neighbours' packets.
- Every process binds UDP 5353 (SO_REUSEPORT), so a unicast reply reaches only one of them.
  zeroconf asks "QU" (unicast-reply) questions when it probes a name and in a browser's first
  query; the reply may land in another process and a duplicate goes unnoticed. So we ask "QM"
  questions, answered by multicast that every process gets: a browser asks QM from the start, and
  an advertiser first asks QM whether its name is taken, then lets zeroconf probe and announce.
- A node's address records hang off a host name of its own (`<instance>.logicpipe.local.`), not
  off the service name (zeroconf's default) nor the machine's `<host>.local.` (one node's goodbye
  would withdraw the others' addresses). With the default, a lookup asks SRV, TXT and A for one
  name; when the A answer comes before the SRV in the packet, zeroconf 0.154 drops it, then lists
  it as a known answer, so it is never sent again and the lookup times out.
"""
from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import re
import socket
from dataclasses import dataclass
from typing import Callable

from zeroconf import DNSQuestionType, InterfaceChoice, NonUniqueNameException, ServiceStateChange, get_all_addresses
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

log = logging.getLogger(__name__)

SERVICE_TYPE = "_logicpipe._tcp.local."
DEFAULT_MESH = "default"  # nodes and controllers of one mesh share its name (--mesh); others ignore them
PROTOCOL_VERSION = "1"  # bumped when nodes and controllers of different versions can no longer talk
TTL_S = 120             # record lifetime: a node gone without a goodbye vanishes from browsers after this
TAKEN_TIMEOUT_MS = 2000  # wait this long for an owner of our name; it may hold its answer 1-1.5 s (RFC 6762 §14)
RESOLVE_TIMEOUT_MS = 3000  # wait this long for a browsed node's SRV, TXT and address records
MAX_ID_BYTES = 128       # node ids travel in a TXT string (at most 255 bytes with its key)


class DuplicateNode(Exception):
    """Another node already advertises this node id."""


@dataclass(frozen=True)
class Advert:
    node_id: str
    address: str  # "host:port" to dial
    protocol: str
    profile_digest: str


def _instance_name(node_id: str) -> str:
    """A DNS label (<= 63 bytes) for the node id; ids changed to fit get a hash so they stay apart."""
    label = re.sub(r"[^A-Za-z0-9_-]", "-", node_id)[:63]
    if label != node_id:
        label = f"{label[:54]}-{hashlib.sha256(node_id.encode()).hexdigest()[:8]}"
    return label


def discovery_interface(chosen: str | None, listen: str, tls: bool) -> str | None:
    """The interface to advertise or browse on: `chosen` (--mdns-interface); else, without TLS,
    only the one the process listens on (its IPv4 address: a plaintext process on 127.0.0.1 must
    neither find nor be found by other hosts); else (TLS, or plaintext on every interface, which
    needs --insecure) every interface (None)."""
    if chosen or tls:
        return chosen or None
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return str(ip) if ip.version == 4 and not ip.is_unspecified else None


def _zeroconf(interface: str | None) -> AsyncZeroconf:
    return AsyncZeroconf(interfaces=[interface] if interface else InterfaceChoice.All)


class Advertiser:
    """Advertises one stage node while started; `start()` refuses a node id already on the network
    (two nodes that start with one id within the same ~2 s may both pass: nothing breaks the tie)."""

    def __init__(self, node_id: str, port: int, *, profile_digest: str = "", interface: str | None = None,
                 host: str | None = None, mesh: str = DEFAULT_MESH):
        if not node_id or len(node_id.encode()) > MAX_ID_BYTES:
            raise ValueError(f"node id must be 1 to {MAX_ID_BYTES} bytes, got {node_id!r}")
        self.node_id, self.port, self.profile_digest = node_id, port, profile_digest
        self.interface, self.host, self.mesh = interface, host, mesh
        label = _instance_name(node_id if mesh == DEFAULT_MESH else f"{node_id}@{mesh}")  # ids are per mesh
        self.name = f"{label}.{SERVICE_TYPE}"
        self.server = f"{label}.logicpipe.local."  # its own host name: see the docstring
        self._zc: AsyncZeroconf | None = None
        self._info: AsyncServiceInfo | None = None

    async def _addresses(self) -> list[str]:
        """`host` unless it means "all interfaces", else `interface`, else this host's non-loopback IPv4."""
        host = (self.host or "").strip("[]")
        if host and host not in ("0.0.0.0", "::"):
            infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
            return list(dict.fromkeys(info[4][0] for info in infos))
        if self.interface:
            return [self.interface]
        return [a for a in get_all_addresses() if not ipaddress.ip_address(a).is_loopback] or ["127.0.0.1"]

    async def start(self) -> None:
        """Register and announce (about 4 s: 2 s asking for the name, zeroconf's probes, announcements)."""
        if self._zc is not None:
            raise RuntimeError(f"advertiser for {self.node_id} already started")
        properties = {"id": self.node_id, "proto": PROTOCOL_VERSION, "digest": self.profile_digest, "mesh": self.mesh}
        info = AsyncServiceInfo(SERVICE_TYPE, self.name, port=self.port, properties=properties, server=self.server,
                                parsed_addresses=await self._addresses(), host_ttl=TTL_S, other_ttl=TTL_S)
        self._zc = _zeroconf(self.interface)
        try:
            owner = AsyncServiceInfo(SERVICE_TYPE, self.name)
            if await owner.async_request(self._zc.zeroconf, TAKEN_TIMEOUT_MS, question_type=DNSQuestionType.QM):
                raise NonUniqueNameException
            await (await self._zc.async_register_service(info))
        except NonUniqueNameException:
            await self.close()
            raise DuplicateNode(f"node id {self.node_id!r} is already advertised on the network "
                                f"(as {self.name}); give this node another --node-id") from None
        except BaseException:
            await self.close()
            raise
        self._info = info
        log.info("advertising node %s as %s at %s port %d", self.node_id, self.name,
                 ", ".join(info.parsed_addresses()), self.port)

    async def close(self) -> None:
        """Say goodbye (browsers drop the node at once) and stop zeroconf; safe to call twice."""
        zc, info, self._zc, self._info = self._zc, self._info, None, None
        if zc is None:
            return
        try:
            if info is not None:
                await (await zc.async_unregister_service(info))
        finally:
            await zc.async_close()


class Browser:
    """Calls `on_add(advert)` when a node appears or changes and `on_remove(node_id)` when it goes."""

    def __init__(self, on_add: Callable[[Advert], None], on_remove: Callable[[str], None], *,
                 interface: str | None = None, mesh: str = DEFAULT_MESH):
        self.on_add, self.on_remove, self.interface, self.mesh = on_add, on_remove, interface, mesh
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._known: dict[str, str] = {}  # instance name -> node id passed to on_add
        self._resolving: dict[str, asyncio.Task] = {}  # instance name -> its lookup in flight

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._zc = _zeroconf(self.interface)
        self._browser = AsyncServiceBrowser(self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_change],
                                            question_type=DNSQuestionType.QM)

    async def close(self) -> None:
        """Stop browsing; no callback runs afterwards. Safe to call twice."""
        zc, browser, self._zc, self._browser = self._zc, self._browser, None, None
        for task in self._resolving.values():
            task.cancel()
        self._resolving.clear()
        if browser is not None:
            await browser.async_cancel()
        if zc is not None:
            await zc.async_close()

    def _on_change(self, zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        """zeroconf's handler (maybe on its own thread): hand over to our loop."""
        self._loop.call_soon_threadsafe(self._dispatch, name, state_change)

    def _dispatch(self, name: str, state_change: ServiceStateChange) -> None:
        if self._zc is None:
            return  # closed
        if (pending := self._resolving.pop(name, None)) is not None:
            pending.cancel()  # a newer change supersedes it
        if state_change is ServiceStateChange.Removed:
            if (node_id := self._known.pop(name, None)) is not None:
                self._call(self.on_remove, node_id)
            return
        task = asyncio.create_task(self._resolve(name), name=f"mdns-resolve {name}")
        self._resolving[name] = task
        task.add_done_callback(lambda t: self._resolving.pop(name, None) if self._resolving.get(name) is t else None)

    async def _resolve(self, name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self._zc.zeroconf, RESOLVE_TIMEOUT_MS, question_type=DNSQuestionType.QM):
            log.warning("mDNS: no answer resolving %s; ignored", name)
            return
        txt = {k: v or "" for k, v in info.decoded_properties.items()}  # bad UTF-8 replaced, never raised
        addresses = info.parsed_addresses()
        if txt.get("proto") != PROTOCOL_VERSION:
            log.warning("mDNS: ignoring %s: protocol %r, this is %r", name, txt.get("proto"), PROTOCOL_VERSION)
            return
        if txt.get("mesh", DEFAULT_MESH) != self.mesh:
            log.debug("mDNS: %s belongs to mesh %r, not %r", name, txt.get("mesh"), self.mesh)
            return
        if not txt.get("id") or not addresses or not info.port:
            log.warning("mDNS: ignoring %s: no node id, address or port", name)
            return
        if self.interface and ipaddress.ip_address(self.interface).is_loopback:
            addresses = [a for a in addresses if ipaddress.ip_address(a).is_loopback]
            if not addresses:  # a record on loopback pointing elsewhere: not a node of this host
                log.warning("mDNS: ignoring %s: browsing loopback only, it advertises %s", name,
                            ", ".join(info.parsed_addresses()))
                return
        host = min(addresses, key=lambda a: ":" in a)  # IPv4 first, in advertised order
        host = f"[{host}]" if ":" in host else host
        advert = Advert(txt["id"], f"{host}:{info.port}", txt["proto"], txt.get("digest", ""))
        if (old := self._known.get(name)) is not None and old != advert.node_id:
            self._call(self.on_remove, old)
        self._known[name] = advert.node_id
        self._call(self.on_add, advert)

    @staticmethod
    def _call(callback: Callable, arg) -> None:
        try:
            callback(arg)
        except Exception:  # noqa: BLE001 — one bad callback must not stop browsing
            log.exception("mDNS browser callback %s failed", getattr(callback, "__name__", callback))
