"""Human units for messages and tables: bytes in binary units, seconds in milliseconds."""
from __future__ import annotations

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(num_bytes: float) -> str:
    """`1536` -> "1.5 KiB", `12 * 2**30` -> "12.0 GiB"; plain bytes below 1 KiB ("512 B")."""
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value < 1024:
        return f"{sign}{value:.0f} B"
    for unit in _BYTE_UNITS[1:]:
        value /= 1024.0
        if value < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{sign}{value:.1f} {unit}"
    raise AssertionError("unreachable")


def format_ms(seconds: float) -> str:
    """Seconds as milliseconds with two decimals: `0.01234` -> "12.34"."""
    return f"{seconds * 1e3:.2f}"
