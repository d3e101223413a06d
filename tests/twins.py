"""Run a test against a compiled type and its pure-Python twin (skipping the first when
the extension is not built)."""

from __future__ import annotations

from typing import Any

import pytest


def native_and_twin(native: Any, twin: Any, extension: str) -> tuple[Any, list[Any]]:
    """``(needs_native, params)``: a skip mark for tests of the native type only, and the
    two implementations as pytest params (ids ``native`` and ``python``)."""
    needs_native = pytest.mark.skipif(
        native is None,
        reason=f"hybridstore.native.{extension} is not built; run `python setup.py build_ext --inplace`")
    return needs_native, [pytest.param(native, id="native", marks=needs_native),
                          pytest.param(twin, id="python")]
