"""API keys of the HTTP API (`logicpipe-controller --http-token-file FILE`): who may call /v1/*.

The file holds one key a line, `NAME TOKEN` or just `TOKEN`; blank lines and `#` comments are
skipped. OpenAI clients send a key as `Authorization: Bearer TOKEN`. A key's name is the client
the front door counts (`key NAME`, so `--max-requests-per-client` caps each key); a key without a
name is named by its token's fingerprint (the first 8 hex digits of its SHA-256), which tells
nothing of the token. Several tokens may share a name (rotating a key): they share its cap.

Every check hashes the token offered and compares the hash with every key's, in constant time and
without stopping at a match, so neither the time nor the order of the file tells a guesser how
close it came. The tokens themselves are kept only as hashes.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from logicpipe.common.transport import is_loopback

log = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16     # shorter tokens can be guessed; make one with `openssl rand -hex 32`
MAX_HEADER_CHARS = 4096  # an Authorization header longer than this is refused before hashing
_TOKEN = re.compile(r"[!-~]+")             # printable ASCII, no spaces
_NAME = re.compile(r"[A-Za-z0-9._@+-]{1,64}")
MAKE_ONE = "make one with `openssl rand -hex 32`"


class KeyFileError(ValueError):
    """The token file cannot be used; the message says what to fix."""


def fingerprint(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class ApiKeys:
    """name and SHA-256 of each token, in file order."""

    keys: tuple[tuple[str, bytes], ...]
    path: str = ""

    @classmethod
    def load(cls, path: str | Path) -> "ApiKeys":
        """The keys in `path`; KeyFileError says what is wrong with it. A file others may read
        logs a warning (its tokens are secrets)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
            mode = path.stat().st_mode
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyFileError(f"--http-token-file {path}: cannot read it ({exc}); give a readable UTF-8 file "
                               f"of API keys, one `NAME TOKEN` a line") from None
        if mode & (stat.S_IROTH | stat.S_IWOTH):
            log.warning("--http-token-file %s can be read or written by every user of this machine; its tokens are "
                        "secrets: chmod 600 %s", path, path)
        keys = parse(text, str(path))
        return cls(keys, str(path))

    @property
    def names(self) -> list[str]:
        return sorted({n for n, _ in self.keys})

    def check(self, authorization: str) -> str | None:
        """The name of the key an `Authorization: Bearer TOKEN` header carries, None for none."""
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(authorization) > MAX_HEADER_CHARS:
            return None
        offered = hashlib.sha256(token.encode("utf-8", "backslashreplace")).digest()
        found = None
        for name, digest in self.keys:  # all of them, whatever matched
            if hmac.compare_digest(offered, digest):
                found = name
        return found


def parse(text: str, where: str = "the token file") -> tuple[tuple[str, bytes], ...]:
    """(name, SHA-256 of the token) of each key line; KeyFileError names the line at fault."""
    keys, seen = [], {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) > 2:
            raise KeyFileError(f"{where}:{n}: a line is `NAME TOKEN` or `TOKEN`, not {len(fields)} fields "
                               "(a token has no spaces)")
        token = fields[-1]
        name = fields[0] if len(fields) == 2 else fingerprint(token)
        if not _NAME.fullmatch(name):
            raise KeyFileError(f"{where}:{n}: the name {name[:70]!r} must be 1 to 64 letters, digits or ._@+-")
        if not _TOKEN.fullmatch(token) or len(token) < MIN_TOKEN_CHARS:
            raise KeyFileError(f"{where}:{n}: a token is at least {MIN_TOKEN_CHARS} printable ASCII characters "
                               f"without spaces; {MAKE_ONE}")
        if token in seen:
            raise KeyFileError(f"{where}:{n}: the same token as line {seen[token]}: one token, one key (give each "
                               f"client its own; {MAKE_ONE})")
        seen[token] = n
        keys.append((name, hashlib.sha256(token.encode()).digest()))
    if not keys:
        raise KeyFileError(f"{where} holds no key: add a line `NAME TOKEN` per client ({MAKE_ONE})")
    return tuple(keys)


def check_exposure(http: str, token_file: str, insecure: bool) -> str:
    """Why the HTTP API must not start on `http` ("HOST:PORT") as configured, or "": off loopback
    it needs a token file unless --insecure says the network is trusted."""
    host = http.rpartition(":")[0]
    if token_file or insecure or is_loopback(host or "127.0.0.1"):
        return ""
    return (f"--http {http} is off loopback: anyone who reaches it could submit requests and read their answers. "
            "Give --http-token-file FILE (API keys, one `NAME TOKEN` a line; clients send `Authorization: Bearer "
            "TOKEN`), bind it to 127.0.0.1 behind an authenticating proxy, or, on a network you trust, --insecure")
