"""mDNS on 127.0.0.1: a browser sees an advertised node come and go; duplicates and other protocol
versions are refused. Real zeroconf instances on loopback; every wait is bounded."""
from __future__ import annotations

import asyncio
import logging
import uuid

import pytest
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from logicpipe.common.discovery import (
    PROTOCOL_VERSION,
    SERVICE_TYPE,
    Advert,
    Advertiser,
    Browser,
    DuplicateNode,
    _instance_name,
    discovery_interface,
)

LOOPBACK = "127.0.0.1"
WAIT_S = 6.0  # a browser sees an announcement or a goodbye well within this


def new_id() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"  # unique, so parallel runs on this host never meet


async def wait_until(condition, timeout_s: float = WAIT_S) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.05)
    await asyncio.wait_for(poll(), timeout_s)


class Seen:
    """Records what a Browser reported."""

    def __init__(self):
        self.added: list[Advert] = []
        self.removed: list[str] = []

    def browser(self) -> Browser:
        return Browser(self.added.append, self.removed.append, interface=LOOPBACK)

    def ids(self) -> set[str]:
        return {a.node_id for a in self.added}


def test_browser_sees_a_node_come_and_go():
    async def main():
        node_id, seen = new_id(), Seen()
        browser = seen.browser()
        advertiser = Advertiser(node_id, 50123, profile_digest="abc123", interface=LOOPBACK, host="0.0.0.0")
        try:
            await browser.start()
            await advertiser.start()
            await wait_until(lambda: node_id in seen.ids())
            [advert] = [a for a in seen.added if a.node_id == node_id]
            assert advert == Advert(node_id, "127.0.0.1:50123", PROTOCOL_VERSION, "abc123")
            await advertiser.close()
            await wait_until(lambda: node_id in seen.removed)
            await advertiser.close()  # a second close does nothing
        finally:
            await advertiser.close()
            await browser.close()
            await browser.close()
    asyncio.run(main())


def test_duplicate_node_id_is_refused():
    async def main():
        node_id = new_id()
        first = Advertiser(node_id, 50124, interface=LOOPBACK)
        second = Advertiser(node_id, 50125, interface=LOOPBACK)
        try:
            await first.start()
            with pytest.raises(DuplicateNode, match=node_id):
                await second.start()
        finally:
            await second.close()
            await first.close()
    asyncio.run(main())


def test_other_protocol_version_is_ignored(caplog):
    async def main():
        ours, theirs, seen = new_id(), new_id(), Seen()
        browser = seen.browser()
        advertiser = Advertiser(ours, 50126, interface=LOOPBACK)
        foreign = AsyncZeroconf(interfaces=[LOOPBACK])
        foreign_info = AsyncServiceInfo(SERVICE_TYPE, f"{theirs}.{SERVICE_TYPE}", port=50127,
                                        parsed_addresses=[LOOPBACK], properties={"id": theirs, "proto": "0"})
        try:
            await browser.start()
            await asyncio.gather(advertiser.start(), foreign.async_register_service(foreign_info))
            await wait_until(lambda: ours in seen.ids() and theirs in caplog.text)
            assert theirs not in seen.ids()
        finally:
            await foreign.async_close()
            await advertiser.close()
            await browser.close()
    with caplog.at_level(logging.WARNING, logger="logicpipe.discovery"):
        asyncio.run(main())


def test_instance_names_fit_a_dns_label_and_stay_apart():
    assert _instance_name("vm-cpu-1a2b3c4d") == "vm-cpu-1a2b3c4d"
    long_a, long_b = "x" * 70 + "a", "x" * 70 + "b"
    names = {_instance_name(long_a), _instance_name(long_b), _instance_name("a.b"), _instance_name("a-b")}
    assert len(names) == 4
    assert all(len(n.encode()) <= 63 and "." not in n for n in names)


def test_a_loopback_browser_ignores_a_record_pointing_at_another_host(caplog):
    """A rogue advertiser of the same mesh on loopback that points at another host's address (a
    plaintext controller must not plan on, nor send prompts to, a node it cannot authenticate)."""
    async def main():
        ours, rogue, seen = new_id(), new_id(), Seen()
        browser = seen.browser()
        advertiser = Advertiser(ours, 50128, interface=LOOPBACK)
        foreign = AsyncZeroconf(interfaces=[LOOPBACK])
        info = AsyncServiceInfo(SERVICE_TYPE, f"{rogue}.{SERVICE_TYPE}", port=50129, parsed_addresses=["192.0.2.7"],
                                properties={"id": rogue, "proto": PROTOCOL_VERSION, "mesh": "default"})
        try:
            await browser.start()
            await asyncio.gather(advertiser.start(), foreign.async_register_service(info))
            await wait_until(lambda: ours in seen.ids() and rogue in caplog.text)
            assert rogue not in seen.ids() and "browsing loopback only" in caplog.text
        finally:
            await foreign.async_close()
            await advertiser.close()
            await browser.close()
    with caplog.at_level(logging.WARNING, logger="logicpipe.discovery"):
        asyncio.run(main())


@pytest.mark.parametrize("chosen, listen, tls, want", [
    (None, "127.0.0.1:50061", False, "127.0.0.1"),    # plaintext on loopback: loopback only
    (None, "localhost:50061", False, "127.0.0.1"),
    (None, "10.1.2.3:50061", False, "10.1.2.3"),      # plaintext (--insecure) on one address: that interface
    (None, "0.0.0.0:50061", False, None),             # plaintext on every interface (--insecure): every one
    (None, "127.0.0.1:50061", True, None),            # TLS: every interface (a record is only a hint)
    ("192.168.1.5", "127.0.0.1:50061", False, "192.168.1.5"),  # --mdns-interface says
])
def test_discovery_stays_on_the_interface_a_plaintext_process_listens_on(chosen, listen, tls, want):
    assert discovery_interface(chosen, listen, tls) == want
