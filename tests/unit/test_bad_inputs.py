"""The pure checkers behind issue 23's refusals: ids, addresses, the Assign fields a stage takes,
a prompt given twice, a join token's lifetime, a revoked name, the Register rate cap; and issue 34's:
one rule for a request id at every door, stop strings capped in count and bytes."""
from __future__ import annotations

import math

import pytest

from logicpipe.common.security import ca as tls_ca
from logicpipe.common.security.bundle import TlsError
from logicpipe.common.security.revocations import Revocations
from logicpipe.controller.mesh.join import JoinAuthority
from logicpipe.controller.jobs.rules import Prompt
from logicpipe.errors import InvalidArgument
from logicpipe.controller.jobs.rules import MAX_STOP_BYTES, MAX_STOPS, check_stops
from logicpipe.limits import (
    MAX_ADDRESS_CHARS,
    MAX_ID_CHARS,
    MAX_REQUEST_ID_CHARS,
    check_address,
    check_id,
    check_request_id,
)
from logicpipe.stage_node.config import MAX_MICRO_BATCHES, Assignment


@pytest.mark.parametrize("address", ["10.0.0.5:50061", "[::1]:1", "[fe80::1%eth0]:65535", "localhost:5",
                                     "jetson-1.local:50061", "jetson-1.local.:8", "my_host:80", "a" * 63 + ".b:1"])
def test_addresses_that_are_host_port(address):
    assert check_address("next_address", address) == address


@pytest.mark.parametrize("address,phrase", [
    ("garbage::x", "port 'x'"), ("h:0", "port '0'"), ("h:65536", "port '65536'"), ("h:-1", "port '-1'"),
    ("h:٣", "port '٣'"), ("::1:80", "brackets"), ("[::1:80", "brackets"), ("[nope]:80", "not an IPv6 address"),
    ("1.2.3:4", "IPv4"), ("256.0.0.1:4", "IPv4"), ("a..b:1", "DNS name"), ("-a:1", "DNS name"), ("a b:1", "DNS name"),
    ("a" * 64 + ":1", "DNS name"), ("h", "no :port"), (":5", "no host"), ("h\x00:5", "control character"),
    ("h" * MAX_ADDRESS_CHARS + ":1", "character cap"),
])
def test_addresses_that_are_not(address, phrase):
    with pytest.raises(InvalidArgument, match="next_address") as info:
        check_address("next_address", address)
    assert phrase in str(info.value) and "\n" not in str(info.value)


def test_an_empty_address_only_where_it_may_be():
    assert check_address("first_address", "", empty_ok=True) == ""
    with pytest.raises(InvalidArgument, match="first_address is empty"):
        check_address("first_address", "")


@pytest.mark.parametrize("value", ["a\x00", "\x1f", "a\x7f", "\x85", "x\u2028y", "tab\there", "cr\r"])
def test_ids_refuse_control_characters(value):
    with pytest.raises(InvalidArgument, match="session_id contains the control character"):
        check_id("session_id", value)


def test_ids_take_printable_text_up_to_the_cap():
    assert check_id("owner", "controller:ctl-1 é 東", empty_ok=True)
    with pytest.raises(InvalidArgument, match=f"over the {MAX_ID_CHARS}-character cap"):
        check_id("prev_node_id", "p" * 100_000, empty_ok=True)


def assignment(**fields) -> Assignment:
    base = dict(model_dir="/models/m", start=0, end=4, num_layers=4, stage_index=0, num_stages=1, next_address="",
                first_address="")
    return Assignment(**{**base, **fields})


def test_assignment_check_refuses_a_nul_path_too_many_stages_and_micro_batches():
    assignment(micro_batches=MAX_MICRO_BATCHES).check()
    for fields, phrase in ((dict(model_dir="/models/m\x00x"), "model_dir contains the control character"),
                           (dict(num_stages=5), "5 stages for 4 layers"),
                           (dict(micro_batches=2**32 - 1), f"cap of {MAX_MICRO_BATCHES}")):
        with pytest.raises(InvalidArgument, match=phrase):
            assignment(**fields).check()


@pytest.mark.parametrize("prompt,phrase", [
    (Prompt(text=" ", messages=(("user", "hi"),)), "not a prompt and messages"),
    (Prompt(text="hi", messages=(("user", "hi"),)), "not a prompt and messages"),
    (Prompt(text="\n", token_ids=(1,)), "not a prompt and prompt token ids"),
    (Prompt(text="  "), "the prompt is empty"), (Prompt(), "the prompt is empty"),
])
def test_a_prompt_is_given_once(prompt, phrase):
    with pytest.raises(InvalidArgument, match=phrase):
        prompt.check()
    Prompt(messages=(("user", "hi"),)).check()
    Prompt(text="  hi ").check()


def test_join_token_lifetime_is_a_finite_number_of_seconds(tmp_path):
    auth = JoinAuthority(tls_ca.init_ca(tmp_path / "ca"), Revocations())
    for bad in (math.nan, math.inf, -math.inf, -1.0):
        with pytest.raises(InvalidArgument, match="ttl_s"):
            auth.create(bad)
    assert auth.create(0)[1] == 3600 and auth.create(5)[1] == 5 and auth.create(1e300)[1] == 24 * 3600


def test_revocations_keep_only_certificate_names(tmp_path):
    r = Revocations(tmp_path / "revoked.json")
    for bad in ("../x", "", "A", "a/b", "n\x00"):
        with pytest.raises(TlsError, match="lowercase"):
            r.add(bad)
    assert not (tmp_path / "revoked.json").exists()
    assert r.add("node-1") and "node-1" in r


def test_register_rate_cap_is_a_bucket_per_caller(monkeypatch):
    from logicpipe.controller.api import service

    now = [100.0]
    monkeypatch.setattr(service.time, "monotonic", lambda: now[0])
    cap = service.RateCap(3, 2.0)
    assert [cap.take("a") for _ in range(4)] == [True, True, True, False]
    assert cap.take("b")  # another caller: its own bucket
    now[0] += 0.5  # one call refilled
    assert cap.take("a") and not cap.take("a")
    now[0] += 60  # full again, never more than the burst
    assert [cap.take("a") for _ in range(4)] == [True, True, True, False]
    monkeypatch.setattr(service, "MAX_RATE_CALLERS", 10)
    for i in range(30):  # many callers: the buckets kept stay bounded
        now[0] += 10
        cap.take(f"c{i}")
    assert len(cap._buckets) <= 11


@pytest.mark.parametrize("rid", ["0f" * 16, "req-1", "a.b_c-D", "r" * MAX_REQUEST_ID_CHARS, "...", "-"])
def test_request_ids_that_are(rid):
    assert check_request_id("request_id", rid) == rid


@pytest.mark.parametrize("rid", ["", "r" * (MAX_REQUEST_ID_CHARS + 1), "../x", "a/../b", "a b", "caf\u00e9", "\u6771",
                                 ".", "..", "a\x00", "a\nb", "a%2Fb", "a:b", "r" * 100_000])
def test_request_ids_that_are_not(rid):
    with pytest.raises(InvalidArgument, match="X-Request-Id") as info:
        check_request_id("X-Request-Id", rid)
    message = str(info.value)
    assert f"1 to {MAX_REQUEST_ID_CHARS} of the characters A-Z a-z 0-9 . _ -" in message and "\n" not in message
    assert len(message) < 400  # a huge id is not echoed whole


def test_stops_are_capped_in_count_and_bytes():
    check_stops(("a",) * MAX_STOPS)
    check_stops(("\u00e9" * (MAX_STOP_BYTES // 2),))  # 2 bytes a character: the cap exactly
    for stops, phrase in ((("a",) * (MAX_STOPS + 1), f"up to {MAX_STOPS}"), (("a", ""), "non-empty"),
                          (("ok", "x" * 2**20), "stop[1] is 1048576 bytes"),
                          (("\u00e9" * (MAX_STOP_BYTES // 2 + 1),), f"stop[0] is {MAX_STOP_BYTES + 2} bytes")):
        with pytest.raises(InvalidArgument, match="stop") as info:
            check_stops(stops)
        assert phrase in str(info.value)
