"""Checkpoint admission: keep every checkpoint the engine puts."""

from __future__ import annotations

from hybridstore.index.prefix import PrefixKeys
from hybridstore.index.trie import HybridIndex
from hybridstore.policy.base import AdmissionPolicy


class KeepAll(AdmissionPolicy):
    """Admit every checkpoint (capacity is then managed by eviction alone)."""

    name = "keep-all"

    def admit(self, index: HybridIndex, position: int, nbytes: int, *,
              prompt: PrefixKeys | None = None) -> bool:
        return True
