"""Traces bundled with the package: a small WEKA agent-trace sample for the default replay."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def weka_sample() -> Path:
    """Directory of the bundled WEKA session files (see its NOTICE.md)."""
    return Path(str(resources.files(__package__) / "weka"))
