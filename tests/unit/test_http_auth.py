"""The HTTP API's keys (controller/api/http_auth.py) and the controller's start-up checks of them: the
token file's format and its refusals (each naming the fix), the Bearer check, and an HTTP API off
loopback refused without a token file unless --insecure."""
from __future__ import annotations

import logging
import os

import pytest

from logicpipe.controller import main
from logicpipe.controller.api.http_auth import MIN_TOKEN_CHARS, ApiKeys, KeyFileError, fingerprint, parse

TOKEN = "t0k3n-" + "x" * 26
OTHER = "0123456789abcdef0123456789abcdef"


def write(tmp_path, text: str, mode: int = 0o600):
    path = tmp_path / "keys"
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_the_file_format(tmp_path):
    keys = ApiKeys.load(write(tmp_path, f"# the team's keys\n\nalice {TOKEN}\n  {OTHER}  \nalice {TOKEN}2\n"))
    assert keys.names == sorted(["alice", fingerprint(OTHER)])
    assert keys.check(f"Bearer {TOKEN}") == "alice" and keys.check(f"Bearer {TOKEN}2") == "alice"
    assert keys.check(f"bearer  {OTHER} ") == fingerprint(OTHER)
    for wrong in ("", "Bearer", f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}",
                  "Bearer \udcff" * 3, "Bearer " + "x" * 10_000):
        assert keys.check(wrong) is None, wrong
    assert TOKEN not in repr(keys)  # only hashes are kept


@pytest.mark.parametrize("text,says", [
    ("", "holds no key"),
    ("# nothing but comments\n\n", "holds no key"),
    (f"alice {TOKEN}\nbob {TOKEN}\n", "the same token as line 1"),
    (f"alice {TOKEN} extra\n", "not 3 fields"),
    ("alice short\n", f"at least {MIN_TOKEN_CHARS}"),
    (f"al/ice {TOKEN}\n", "letters, digits"),
    (f"alice {TOKEN}é\n", "printable ASCII"),
])
def test_a_bad_file_is_refused_naming_the_line_and_the_fix(tmp_path, text, says):
    with pytest.raises(KeyFileError) as info:
        ApiKeys.load(write(tmp_path, text))
    assert says in str(info.value) and str(tmp_path / "keys") in str(info.value)


def test_an_unreadable_file_is_refused_and_a_world_readable_one_warned_of(tmp_path, caplog):
    with pytest.raises(KeyFileError, match="cannot read it"):
        ApiKeys.load(tmp_path / "missing")
    with caplog.at_level(logging.WARNING):
        ApiKeys.load(write(tmp_path, f"alice {TOKEN}\n", 0o644))
    assert "chmod 600" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ApiKeys.load(write(tmp_path, f"alice {TOKEN}\n", 0o600))
    assert not caplog.text


def test_parse_names_the_line(tmp_path):
    with pytest.raises(KeyFileError, match=r"keys:3:"):
        parse(f"# x\nalice {TOKEN}\nbob {TOKEN}\n", "keys")


def test_the_http_api_off_loopback_needs_a_token_file_or_insecure(tmp_path, capsys):
    for http in ("0.0.0.0:8000", "[::]:8000", "192.168.1.10:8000"):
        with pytest.raises(SystemExit) as info:
            main.parse_args(["--http", http])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "--http-token-file" in err and "--insecure" in err and "off loopback" in err
    assert main.parse_args(["--http", "127.0.0.1:8000"]).http_keys is None
    assert main.parse_args(["--http", "localhost:8000"]).http_keys is None
    assert main.parse_args(["--http", "0.0.0.0:8000", "--insecure"]).http_keys is None
    keys = write(tmp_path, f"alice {TOKEN}\n")
    args = main.parse_args(["--http", "0.0.0.0:8000", "--http-token-file", str(keys)])
    assert args.http_keys.check(f"Bearer {TOKEN}") == "alice"
    # a bad file and a token file without --http stop the start, naming the fix
    with pytest.raises(SystemExit):
        main.parse_args(["--http", "0.0.0.0:8000", "--http-token-file", str(write(tmp_path, "# none\n"))])
    assert "holds no key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main.parse_args(["--http-token-file", str(keys)])
    assert "give --http" in capsys.readouterr().err
