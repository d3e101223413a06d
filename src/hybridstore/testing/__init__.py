"""Test helpers that ship with the package (as ``zarr.testing`` does).

:mod:`hybridstore.testing.tiers` holds the conformance suite of the tier
contract: subclass :class:`~hybridstore.testing.tiers.TierConformance` and
implement ``make_tier`` to check a tier of your own.  Importing it needs
``pytest`` and ``hypothesis`` (the ``test`` extra).
"""

from hybridstore.testing.tiers import TierConformance, blob, is_blob, key_of

__all__ = ["TierConformance", "blob", "is_blob", "key_of"]
