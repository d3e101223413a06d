"""Run a test with a compiled extension and with its pure-Python twin, through the one
switch, :func:`hybridstore._native.use_twins`.

A native case skips when its extension is not built, and FAILS instead when
``HYBRIDSTORE_REQUIRE_NATIVE=1`` is set in the environment: CI sets it (as it does for
the build), so a green run means the C was built and tested.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import pytest

from hybridstore import _native

REQUIRE_NATIVE = os.environ.get("HYBRIDSTORE_REQUIRE_NATIVE", "") == "1"


def require_native(name: str) -> None:
    """Skip the running test unless the extension ``name`` is built (fail instead with
    ``HYBRIDSTORE_REQUIRE_NATIVE=1``)."""
    if _native.available()[name]:
        return
    message = (f"hybridstore._cext.{name} is not built; run "
               f"`python setup.py build_ext --inplace`")
    if REQUIRE_NATIVE:
        pytest.fail(f"{message} (HYBRIDSTORE_REQUIRE_NATIVE=1 requires it)")
    pytest.skip(message)


def needs_native(name: str) -> pytest.MarkDecorator:
    """A mark for a test of the compiled ``name`` only: skips it when the extension is not
    built, unless ``HYBRIDSTORE_REQUIRE_NATIVE=1``; the test reaches the extension through
    :func:`extension` or :func:`running`, which then fail it."""
    return pytest.mark.skipif(
        not _native.available()[name] and not REQUIRE_NATIVE,
        reason=f"hybridstore._cext.{name} is not built; run `python setup.py build_ext --inplace`")


def extension(name: str) -> ModuleType:
    """The compiled module ``hybridstore._cext.<name>``, for tests of the extension itself
    (after :func:`require_native`)."""
    require_native(name)
    module = _native._BUILT[name]
    assert module is not None
    return module


@contextmanager
def running(name: str, native: bool) -> Iterator[None]:
    """Inside: the built extensions when ``native`` (requiring ``name``), else the twins."""
    if native:
        require_native(name)
    with _native.use_twins(not native):
        yield


Impl = Callable[..., Any]
"""A constructor of the type under test (the public one, which honours the switch)."""


def native_and_twin(name: str, make: Impl) -> Any:
    """A fixture named ``impl``, parametrized ``native`` / ``python``: the test runs inside
    :func:`running` and gets ``make``, the public constructor, which then makes the
    compiled type or the twin.  Bind it to the module-level name ``impl``."""

    @pytest.fixture(name="impl", params=[True, False], ids=["native", "python"])
    def fixture(request: pytest.FixtureRequest) -> Iterator[Impl]:
        with running(name, request.param):
            yield make

    return fixture


def native_or_twin(name: str) -> Any:
    """A fixture named ``native``, parametrized ``native`` / ``python``: the test runs inside
    :func:`running` and gets ``True`` for the compiled case.  Bind it to the module-level
    name ``native``."""

    @pytest.fixture(name="native", params=[True, False], ids=["native", "python"])
    def fixture(request: pytest.FixtureRequest) -> Iterator[bool]:
        with running(name, request.param):
            yield request.param

    return fixture
