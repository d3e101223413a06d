"""Sizes and switches as people write them: ``parse_bytes("8GiB")``, ``parse_flag("off")``.

The lowest layer beside ``errors``: :mod:`hybridstore.config` and
:mod:`hybridstore.remote_url` read sizes with it.
"""

from __future__ import annotations

import re

from hybridstore.errors import ConfigError

__all__ = ["TRUE_WORDS", "parse_bytes", "parse_flag"]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
          "tib": 1 << 40}


def parse_bytes(text: str | int) -> int:
    """Parse ``"8GiB"``, ``"512 MB"``, ``"4096"`` or an int into a byte count."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot read {text!r} as a size; write e.g. '8GiB', '512MB' or '4096'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_flag(value: bool | str, name: str) -> bool:
    """A switch given as a bool or a word (``"true"``, ``"off"``, ``"0"``, ...).

    Raises:
        ConfigError: neither (``name`` says which setting).
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    raise ConfigError(f"{name} must be true or false, got {value!r}")
