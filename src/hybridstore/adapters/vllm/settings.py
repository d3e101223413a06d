"""What the vLLM adapter reads from ``kv_connector_extra_config`` and ``OffloadingConfig``.

vLLM hands every offloading spec one untyped ``extra_config`` dict (the
``kv_connector_extra_config`` of ``--kv-transfer-config``); this module turns it
into one frozen, validated :class:`VllmSettings` and decides how vLLM's KV cache
groups map onto a :class:`~hybridstore.HybridStore`:

=========================  ===========================================  ==================
extra-config key           meaning                                      default
=========================  ===========================================  ==================
``disk_path``              the store's SSD directory (lmdb catalog +    required
                           segment files); durable across restarts;
                           ``<disk_path>/dp<i>`` per data-parallel rank
``disk_bytes``             SSD budget (int or ``"64GiB"``)              ``64GiB``
``host_bytes``             pinned-DRAM pool budget                      ``1GiB``
``policy``                 eviction policy (``hybridstore.policy``)     ``"lru"``
``checkpoint_policy``      which Mamba states are kept                  ``"keep-all"``
``tier_policy``            DRAM/SSD placement                           ``"write-through"``
``disk_engine``            ``auto`` / ``kvikio`` / ``posix``            ``"auto"``
``io_threads``             disk I/O threads                             ``8``
``namespace``              extra tenant tag mixed into every key        ``""``
``staging_bytes``          shared staging region (scheduler <->         ``256MiB``
                           workers), rounded down to whole slots
``staging_dir``            where the staging file lives                 ``/dev/shm``
``load_timeout_s``         how long a worker waits for staged bytes     ``120``
``io_chunk_bytes``         largest SSD request                          ``8MiB``
``verify_checksums``       check every object read                      ``true``

``locality``               ``"LOCAL"`` / ``"REMOTE"``: the KV events'      ``None``
                           locality (vLLM's tier key)
``enable_kv_events``       emit KV cache events (when vLLM's             ``true``
                           ``kv_events_config`` enables them)
=========================  ===========================================  ==================

vLLM's own keys that every offloading spec may be given (:data:`VLLM_KEYS`:
``spec_name``, ``spec_module_path``, ``block_size`` or ``blocks_per_chunk``,
``offload_prompt_only``, ...) pass through untouched; any other key is a
:class:`~hybridstore.errors.ConfigError` (a misspelt ``disk_byte`` must not
silently leave the budget at its default).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridstore.adapters.vllm.staging import PREFIX, SUFFIX
from hybridstore.config import StoreConfig, parse_bytes
from hybridstore.errors import ConfigError, UnsupportedModelError
from hybridstore.units import parse_flag

_STORE_KEYS = ("disk_bytes", "host_bytes", "policy", "checkpoint_policy", "tier_policy",
               "disk_engine", "io_threads", "io_chunk_bytes", "verify_checksums")
ADAPTER_KEYS = frozenset(("disk_path", "namespace", "staging_bytes", "staging_dir",
                          "load_timeout_s", "locality", "enable_kv_events", *_STORE_KEYS))
"""The ``kv_connector_extra_config`` keys :class:`HybridStoreSpec` reads."""
VLLM_KEYS = frozenset(("spec_name", "spec_module_path", "block_size", "blocks_per_chunk",
                       "offload_prompt_only", "canonical_layout", "self_describing_kv_events",
                       "sync_load_budget_bytes"))
"""Keys vLLM's ``OffloadingConnector`` itself reads for any offloading spec (0.31-0.34)."""


def check_keys(extra: Mapping[str, Any], own: frozenset[str], where: str) -> None:
    """Reject keys neither the adapter nor vLLM reads (a typo must not pass silently).

    Raises:
        ConfigError: naming the unknown keys and the known ones.
    """
    unknown = sorted(set(extra) - own - VLLM_KEYS)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; hybridstore reads "
                          f"{sorted(own)} and vLLM {sorted(VLLM_KEYS)}")


def store_kwargs(settings: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """The :class:`~hybridstore.StoreConfig` fields among ``keys`` that ``settings`` gives
    (sizes as ints or ``"64GiB"``, flags as bools or ``"false"``)."""
    out: dict[str, Any] = {}
    for key in keys:
        if key in settings:
            value = settings[key]
            out[key] = (parse_bytes(value) if key.endswith("_bytes") else
                        parse_flag(value, key) if key == "verify_checksums" else value)
    return out


def parse_locality(value: Any) -> Any:
    """vLLM's ``Locality`` of a ``locality`` setting (``None``: not given).

    Raises:
        ConfigError: not ``"LOCAL"`` or ``"REMOTE"``.
    """
    if value is None:
        return None
    from vllm.v1.kv_offload.base import Locality
    try:
        return Locality(str(value).upper())
    except ValueError:
        raise ConfigError(f"locality must be 'LOCAL' or 'REMOTE', got {value!r}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupPlan:
    """How vLLM's offloaded KV cache groups map onto one store.

    Attributes:
        page_group: position (in ``OffloadingConfig.groups``) of the one
            full-attention group; its chunks are the store's KV pages.
        state_groups: positions of the Mamba (one-chunk window) groups; their
            blocks at one chunk boundary together form the store's checkpoint
            at that position.
        group_ids: vLLM's KV cache group id of every position (the 4-byte
            suffix of an offload key).
        tokens_per_chunk: tokens of one offloaded chunk, per position.
    """

    page_group: int
    state_groups: tuple[int, ...]
    group_ids: tuple[int, ...]
    tokens_per_chunk: tuple[int, ...]

    @classmethod
    def of(cls, groups: Any, blocks_per_chunk: int,
           windows: Sequence[int | None] | None = None) -> GroupPlan:
        """Classify ``OffloadingConfig.groups``.

        Args:
            groups: ``OffloadingConfig.groups``.
            blocks_per_chunk: GPU blocks per offloaded chunk.
            windows: each group's window in chunks (``compat.group_windows``);
                by default read from the groups (vLLM 0.33+).

        Raises:
            UnsupportedModelError: no full-attention group, more than one, or a
                sliding-window group wider than one chunk (its window of
                several chunks is not a prefix page nor a single state).
        """
        if windows is None:
            windows = [g.sliding_window_size_in_chunks for g in groups]
        full, states = [], []
        for pos, (g, window) in enumerate(zip(groups, windows, strict=True)):
            if window is None:
                full.append(pos)
            elif window == 1:
                states.append(pos)
            else:
                raise UnsupportedModelError(
                    f"KV cache group {g.group_id} is a sliding window of {window} chunks; the "
                    "hybridstore vLLM adapter keeps full-attention pages and one-chunk (Mamba) "
                    "states only. Use vLLM's CPUOffloadingSpec for this model.")
        if len(full) != 1:
            raise UnsupportedModelError(
                f"the hybridstore vLLM adapter needs exactly one full-attention KV cache group, "
                f"this model has {len(full)} (groups {[groups[p].group_id for p in full]}); "
                "its pages are the store's prefix pages. Use vLLM's CPUOffloadingSpec for "
                "this model.")
        return cls(page_group=full[0], state_groups=tuple(states),
                   group_ids=tuple(g.group_id for g in groups),
                   tokens_per_chunk=tuple(g.tokens_per_block * blocks_per_chunk for g in groups))

    @property
    def page_tokens(self) -> int:
        """Tokens per store page (the full-attention chunk)."""
        return self.tokens_per_chunk[self.page_group]

    def position_of(self, group_id: int) -> int:
        """Position in ``OffloadingConfig.groups`` of vLLM group ``group_id``."""
        return self.group_ids.index(group_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmSettings:
    """The adapter's settings, read once from ``kv_connector_extra_config``.

    Attributes:
        store: the store's configuration (block size = the full-attention chunk).
        staging_path: the shared staging file scheduler and workers map.
        staging_bytes: its size budget.
        load_timeout_s: how long a worker waits for the manager to stage a load.
        locality: vLLM's ``Locality`` the KV events carry, or None.
        enable_kv_events: emit KV events when vLLM enables them.
    """

    store: StoreConfig
    staging_path: str
    staging_bytes: int
    load_timeout_s: float
    locality: Any = None
    enable_kv_events: bool = True

    @classmethod
    def from_config(cls, config: Any, plan: GroupPlan) -> VllmSettings:
        """Settings for one engine from its ``OffloadingConfig``.

        The store namespace names everything that fixes the byte layout of a
        page (model, cache dtype, parallel layout, chunk size, per-worker
        bytes), never the engine id: a restarted engine must find its keys.
        """
        extra: Mapping[str, Any] = config.extra_config
        check_keys(extra, ADAPTER_KEYS, "kv_connector_extra_config")
        disk_path = extra.get("disk_path")
        if not disk_path:
            raise ConfigError("kv_connector_extra_config needs 'disk_path': the directory of "
                              "hybridstore's SSD tier (it survives restarts), e.g. /nvme/hs")
        par = config.parallel
        tag = "|".join(str(x) for x in (
            "vllm", config.model.name, config.model.dtype, f"ws{par.world_size}",
            f"tp{par.tp_size}", f"pp{par.pp_size}", f"pcp{par.pcp_size}", f"dcp{par.dcp_size}",
            f"chunk{plan.page_tokens}",
            f"kv{config.worker_kv_bytes_per_block}", config.kv_cache_layout,
            "canonical" if config.canonical_layout else "direct", extra.get("namespace", "")))
        kwargs = store_kwargs(extra, _STORE_KEYS)
        if par.data_parallel_size > 1:
            # one process holds a disk tier (an exclusive lock): one directory per DP engine
            disk_path = os.path.join(str(disk_path), f"dp{par.data_parallel_index}")
        store = StoreConfig(block_size=plan.page_tokens, namespace=tag, disk_path=str(disk_path),
                            **kwargs)
        engine = re.sub(r"[^A-Za-z0-9_.-]", "_", str(config.engine_id))
        staging_dir = str(extra.get("staging_dir") or
                          ("/dev/shm" if os.path.isdir("/dev/shm") else disk_path))
        return cls(store=store,
                   staging_path=os.path.join(staging_dir, f"{PREFIX}{engine}{SUFFIX}"),
                   staging_bytes=parse_bytes(extra.get("staging_bytes", 256 << 20)),
                   load_timeout_s=float(extra.get("load_timeout_s", 120.0)),
                   locality=parse_locality(extra.get("locality")),
                   enable_kv_events=parse_flag(extra.get("enable_kv_events", True),
                                               "enable_kv_events"))
