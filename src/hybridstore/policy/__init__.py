"""Policies: eviction ranking, checkpoint admission and placement (pure, no I/O)."""

from __future__ import annotations

from hybridstore.errors import ConfigError
from hybridstore.policy.admission import KeepAll
from hybridstore.policy.base import (
    AdmissionPolicy,
    EvictionPolicy,
    PlacementPolicy,
    ResidenceStats,
    Victim,
)
from hybridstore.policy.lru import LRUEviction
from hybridstore.policy.placement import RequestEnd

EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUEviction}
ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {"keep-all": KeepAll}


def eviction_policy(name: str) -> EvictionPolicy:
    """The eviction policy called ``name``; ConfigError lists the known ones."""
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}; choose one of {sorted(EVICTION_POLICIES)}") from None


def admission_policy(name: str) -> AdmissionPolicy:
    """The checkpoint admission policy called ``name``."""
    try:
        return ADMISSION_POLICIES[name]()
    except KeyError:
        raise ConfigError(
            f"unknown checkpoint_policy {name!r}; choose one of {sorted(ADMISSION_POLICIES)}") from None


__all__ = ["AdmissionPolicy", "EvictionPolicy", "KeepAll", "LRUEviction", "PlacementPolicy",
           "RequestEnd", "ResidenceStats", "Victim", "admission_policy", "eviction_policy"]
