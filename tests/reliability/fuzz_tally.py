"""What the fuzz campaign saw: cases per target, typed errors by class, defects.

A *defect* is an exception that does not derive from
:class:`~hybridstore.errors.HybridStoreError`, a rejected call that changed the store,
bytes that do not come back exactly, a loader that hangs or allocates without bound.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridstore.errors import HybridStoreError

SRC = str(Path(__file__).parents[2] / "src")


class Defect(AssertionError):
    """Raised in strict mode (the in-suite form) so hypothesis shrinks the example."""


def _where(exc: BaseException) -> str:
    """The innermost frame of ``exc`` in hybridstore's sources (else the innermost one)."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "hybridstore" in f.filename and "tests" not in f.filename]
    f = (ours or frames or [None])[-1]
    if f is None:
        return "?"
    name = f.filename.split("/src/")[-1] if "/src/" in f.filename else Path(f.filename).name
    return f"{name}:{f.lineno} ({f.name})"


@dataclass
class Tally:
    """Counts of one campaign.  ``strict``: raise :class:`Defect` at the first defect."""

    strict: bool = False
    cases: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)
    typed: Counter[str] = field(default_factory=Counter)
    accepted: Counter[str] = field(default_factory=Counter)
    runs: Counter[str] = field(default_factory=Counter)
    """Hypothesis examples of a target whose cases are steps (the state machine's runs)."""
    defects: dict[str, dict[str, Any]] = field(default_factory=dict)
    tick: Callable[[], None] | None = None

    def case(self, target: str) -> None:
        self.cases[target] += 1
        if self.tick is not None:
            self.tick()

    def run(self, target: str, call: str, fn: Callable[[], Any], example: Any = None
            ) -> tuple[str, Any]:
        """Run one call: ``("ok", result)``, ``("typed", error)`` or ``("defect", error)``."""
        self.calls[target] += 1
        try:
            result = fn()
        except HybridStoreError as e:
            self.typed[type(e).__name__] += 1
            return "typed", e
        except Exception as e:  # noqa: BLE001 - the point: anything else is a defect
            self.defect(target, call, f"{type(e).__name__} at {_where(e)}",
                        f"{type(e).__name__}: {e}", example)
            return "defect", e
        self.accepted[target] += 1
        return "ok", result

    def defect(self, target: str, call: str, kind: str, message: str, example: Any = None) -> None:
        """Record a defect (one entry per target, call and kind, with its first example)."""
        sig = f"{target} | {call} | {kind}"
        entry = self.defects.setdefault(sig, {"target": target, "call": call, "kind": kind,
                                              "count": 0, "message": str(message)[:300],
                                              "example": _short(example)})
        entry["count"] += 1
        if self.strict:
            raise Defect(f"{sig}: {message} (example {_short(example)})")

    def summary(self) -> dict[str, Any]:
        return {"cases": dict(self.cases), "total_cases": sum(self.cases.values()),
                "calls": dict(self.calls), "accepted_calls": dict(self.accepted), "runs": dict(self.runs),
                "typed_errors": dict(self.typed.most_common()),
                "defects": sorted(self.defects.values(), key=lambda d: -d["count"]),
                "n_defects": len(self.defects)}


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as e:  # noqa: BLE001 - repr of a hostile value may itself fail
        text = f"<unrepresentable {type(value).__name__}: {type(e).__name__}>"
    return text if len(text) <= 240 else text[:240] + "..."
