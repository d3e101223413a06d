"""The store settings of the SGLang adapter, read from SGLang's storage extra config.

``--hicache-storage-backend-extra-config`` is one JSON object (or ``@file.json``,
``.toml``, ``.yaml``).  SGLang pops its own prefetch keys
(``prefetch_threshold``, ``prefetch_timeout_base``,
``prefetch_timeout_per_ki_token``, ``hicache_storage_pass_prefix_keys``,
``tp_lcm_size``) and hands the rest to the backend as
``HiCacheStorageConfig.extra_config``.  Of those, the adapter reads:

=======================  ============================  =====================================
key                      default                       meaning
=======================  ============================  =====================================
``disk_path``            ``file_storage_path``, else   SSD tier directory; each rank uses the
                         none (DRAM only)              subdirectory ``tp{r}of{n}_pp{p}of{q}``
``disk_bytes``           ``64GiB``                     SSD budget per rank (int or ``"64GiB"``)
``host_bytes``           ``1GiB``                      pinned-DRAM budget per rank
``policy``               ``"lru-radix"``               eviction policy (``StoreConfig.policy``)
``checkpoint_policy``    ``"keep-all"``                which Mamba states are kept
``tier_policy``          ``"write-through"``           DRAM/SSD placement
``namespace``            ``""``                        tenant salt (stores with different
                                                       namespaces never share objects)
``disk_engine``          ``"auto"``                    ``"kvikio"``, ``"posix"`` or ``"auto"``
``io_threads``           ``8``                         SSD I/O threads
``verify_checksums``     ``true``                      check every object read from SSD
``pin_host_memory``      ``true``                      page-lock the DRAM tier (with a GPU)
``page_size``            the host pool's               tokens per page (must equal SGLang's)
=======================  ============================  =====================================

Keys SGLang itself reads and passes through are accepted and ignored
(``backend_name``, ``module_path``, ``class_name``, ``interface_v1``;
``file_storage_path`` from ``--file-storage-path`` is the default
``disk_path``).  Any other key is a :class:`~hybridstore.errors.ConfigError`
at startup, naming the accepted keys.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridstore.config import StoreConfig, parse_bytes
from hybridstore.errors import ConfigError
from hybridstore.policy import ADMISSION_POLICIES, EVICTION_POLICIES

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1",
                         "file_storage_path", "tp_lcm_size"})
"""Extra-config keys that belong to SGLang (accepted, not the adapter's)."""

_DEFAULTS = StoreConfig()


@dataclass(frozen=True, slots=True, kw_only=True)
class SGLangSettings:
    """The adapter's settings (see the module table)."""

    disk_path: str | None = None
    disk_bytes: int = _DEFAULTS.disk_bytes
    host_bytes: int = _DEFAULTS.host_bytes
    policy: str = "lru-radix"
    """SGLang's own radix-tree LRU (a leaf leaves whole, its state with its KV): SGLang
    writes back one state per radix node end, so eq. 7 (``hybridstore``, ``histate``) has
    no checkpoints to choose between, and recency decides.  Measured through this adapter
    (``hybridstore bench engines --only policy``) and in the replay with request-end
    placement, it keeps as much as or more than ``lru``, ``histate`` and ``hybridstore``
    (docs/engines/sglang.md)."""
    checkpoint_policy: str = _DEFAULTS.checkpoint_policy
    tier_policy: str = _DEFAULTS.tier_policy
    namespace: str = ""
    disk_engine: str = _DEFAULTS.disk_engine
    io_threads: int = _DEFAULTS.io_threads
    verify_checksums: bool = _DEFAULTS.verify_checksums
    pin_host_memory: bool = _DEFAULTS.pin_host_memory
    page_size: int | None = None

    def __post_init__(self) -> None:
        if self.page_size is not None and (not isinstance(self.page_size, int) or self.page_size < 1):
            raise ConfigError(f"page_size must be a positive int, got {self.page_size!r}")
        if not isinstance(self.namespace, str):
            raise ConfigError(f"namespace must be a string, got {self.namespace!r}")
        for name, known in (("policy", EVICTION_POLICIES), ("checkpoint_policy", ADMISSION_POLICIES)):
            if getattr(self, name) not in known:
                raise ConfigError(f"{name} must be one of {sorted(known)}, got {getattr(self, name)!r}")
        # the rest is checked where StoreConfig checks it (a throwaway config: no store opens)
        store_config(self, RankIdentity(), block_size=self.page_size or 1, layout="")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> SGLangSettings:
        """Read the adapter's keys from ``HiCacheStorageConfig.extra_config``.

        Raises:
            ConfigError: an unknown key, or a value of the wrong kind.
        """
        extra = dict(extra or {})
        own = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(extra) - own - SGLANG_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown hybridstore key(s) {unknown} in --hicache-storage-backend-extra-config; "
                f"the adapter reads {sorted(own)} (and passes SGLang's {sorted(SGLANG_KEYS)})")
        kwargs: dict[str, Any] = {k: v for k, v in extra.items() if k in own}
        if kwargs.get("disk_path") is None and extra.get("file_storage_path"):
            kwargs["disk_path"] = extra["file_storage_path"]
        for name in ("disk_bytes", "host_bytes"):
            if name in kwargs:
                kwargs[name] = parse_bytes(kwargs[name])
        for name in ("verify_checksums", "pin_host_memory"):
            if name in kwargs and not isinstance(kwargs[name], bool):
                raise ConfigError(f"{name} must be true or false, got {kwargs[name]!r}")
        return cls(**kwargs)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankIdentity:
    """Which shard of the model's cache this process holds (from ``HiCacheStorageConfig``).

    Attributes:
        replicated_kv: the KV is the same on every TP rank (MLA, DeepSeek-V4:
            SGLang's ``is_mla_model``); its namespace then has no TP rank.
        writer: this rank writes the (replicated) KV (``is_storage_writer``).
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dp_rank: int = 0
    replicated_kv: bool = False
    writer: bool = True
    model_name: str = ""

    @classmethod
    def of(cls, storage_config: Any) -> RankIdentity:
        """From SGLang's ``HiCacheStorageConfig`` (read by attribute)."""
        g = storage_config
        return cls(tp_rank=int(g.tp_rank), tp_size=int(g.tp_size), pp_rank=int(g.pp_rank),
                   pp_size=int(g.pp_size), cp_rank=int(getattr(g, "attn_cp_rank", 0) or 0),
                   cp_size=int(getattr(g, "attn_cp_size", 1) or 1),
                   dp_rank=int(getattr(g, "dp_rank", 0) or 0),
                   replicated_kv=bool(g.is_mla_model), writer=bool(g.is_storage_writer),
                   model_name=str(g.model_name or ""))

    @property
    def directory(self) -> str:
        """This rank's subdirectory of ``disk_path`` (one store per process: the disk
        tier is opened by one process at a time)."""
        name = f"tp{self.tp_rank}of{self.tp_size}_pp{self.pp_rank}of{self.pp_size}"
        if self.cp_size > 1:
            name += f"_cp{self.cp_rank}of{self.cp_size}"
        if self.dp_rank:
            name += f"_dp{self.dp_rank}"
        return name

    def namespace(self, tenant: str, layout: str) -> str:
        """The store namespace: engine, tenant, model, page/state layout and shard.

        TP-replicated KV leaves the TP rank out (every rank's bytes are equal);
        DP replicas of one attention-TP rank hold equal shards and share it too.
        """
        shard = f"pp{self.pp_rank}of{self.pp_size}"
        if not self.replicated_kv:
            shard = f"tp{self.tp_rank}of{self.tp_size}|" + shard
        if self.cp_size > 1:
            shard += f"|cp{self.cp_rank}of{self.cp_size}"
        return f"sglang|{tenant}|{self.model_name}|{layout}|{shard}"


def store_config(settings: SGLangSettings, rank: RankIdentity, *, block_size: int,
                 layout: str) -> StoreConfig:
    """The :class:`StoreConfig` of one rank's store."""
    disk = None if settings.disk_path is None else os.path.join(settings.disk_path, rank.directory)
    return StoreConfig(block_size=block_size, namespace=rank.namespace(settings.namespace, layout),
                       host_bytes=settings.host_bytes, disk_path=disk, disk_bytes=settings.disk_bytes,
                       policy=settings.policy, checkpoint_policy=settings.checkpoint_policy,
                       tier_policy=settings.tier_policy, disk_engine=settings.disk_engine,
                       io_threads=settings.io_threads, verify_checksums=settings.verify_checksums,
                       pin_host_memory=settings.pin_host_memory)
