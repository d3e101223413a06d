"""The ``remote`` tier: objects in a Mooncake Store shared by many stores (docs/remote.md).

=================  ===============================================================
module             role
=================  ===============================================================
``hybridstore.remote_url``  ``StoreConfig.remote`` (``mooncake://HOST:PORT?...``) parsed (beside config)
``frame.py``       a value's header, meta and seal (keyed MAC, optional encryption); names
``client.py``      the Mooncake client, imported lazily, every call bounded, a
                   failed master counted down for a while
``staging.py``     the registered staging arena puts and gets go through
``tier.py``        :class:`MooncakeTier`, the tier contract
=================  ===============================================================

Mooncake is imported only when a tier is opened: ``pip install
mooncake-transfer-engine-non-cuda`` (the ``remote`` extra) brings it.
"""

from hybridstore.remote_url import RemoteSpec, parse_remote

__all__ = ["MooncakeTier", "RemoteSpec", "parse_remote"]


def __getattr__(name: str) -> object:
    if name == "MooncakeTier":
        from hybridstore.backends.remote.tier import MooncakeTier

        return MooncakeTier
    raise AttributeError(name)
