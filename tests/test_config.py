"""StoreConfig: the one place environment variables are read, and its validation.

Every ``HYBRIDSTORE_*`` variable of ``config.py``'s module table is read by
``from_env``; ``parse_bytes`` reads sizes with and without units and rejects
what it cannot read; each check of ``__post_init__`` raises ``ConfigError``
(also a ``ValueError``) with the field's name in the message.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

import hybridstore.config as config_module
from hybridstore.config import DISK_ENGINES, TIER_POLICY_NAMES, StoreConfig, parse_bytes
from hybridstore.errors import ConfigError, HybridStoreError

# One value per variable of the module table, and the field value it must give.
ENV_CASES: dict[str, tuple[str, str, object]] = {
    "HYBRIDSTORE_BLOCK_SIZE": ("32", "block_size", 32),
    "HYBRIDSTORE_NAMESPACE": ("tenant-a", "namespace", "tenant-a"),
    "HYBRIDSTORE_HOST_BYTES": ("8GiB", "host_bytes", 8 << 30),
    "HYBRIDSTORE_DISK_PATH": ("/nvme/hs", "disk_path", "/nvme/hs"),
    "HYBRIDSTORE_DISK_BYTES": ("512 GB", "disk_bytes", 512 * 10**9),
    "HYBRIDSTORE_DEVICE_BYTES": ("4096", "device_bytes", 4096),
    "HYBRIDSTORE_POLICY": ("histate", "policy", "histate"),
    "HYBRIDSTORE_TIER_POLICY": ("write-back", "tier_policy", "write-back"),
    "HYBRIDSTORE_DISK_ENGINE": ("posix", "disk_engine", "posix"),
    "HYBRIDSTORE_DISK_SHARED": ("1", "disk_shared", True),
    "HYBRIDSTORE_IO_THREADS": ("8", "io_threads", 8),
    "HYBRIDSTORE_IO_CHUNK_BYTES": ("2MiB", "io_chunk_bytes", 2 << 20),
    "HYBRIDSTORE_HASH_SECRET": ("00" * 16 + "ff" * 16, "hash_secret", bytes(16) + b"\xff" * 16),
}


def documented_variables() -> list[str]:
    """The variables named in the module docstring's table."""
    return re.findall(r"``(HYBRIDSTORE_[A-Z_]+)``", config_module.__doc__ or "")


def test_the_table_and_the_cases_name_the_same_variables():
    assert sorted(documented_variables()) == sorted(ENV_CASES)


@pytest.mark.parametrize("variable", sorted(ENV_CASES))
def test_from_env_reads_each_documented_variable(variable, monkeypatch):
    raw, field, expected = ENV_CASES[variable]
    for name in ENV_CASES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, raw)
    cfg = StoreConfig.from_env()
    assert getattr(cfg, field) == expected
    untouched = {f.name for f in dataclasses.fields(StoreConfig)} - {field}
    default = StoreConfig()
    assert all(getattr(cfg, name) == getattr(default, name) for name in untouched)


def test_each_documented_variable_names_a_field():
    fields = {f.name for f in dataclasses.fields(StoreConfig)}
    for variable in documented_variables():
        assert variable.removeprefix("HYBRIDSTORE_").lower() in fields


def test_from_env_all_at_once_from_a_mapping():
    env = {name: raw for name, (raw, _, _) in ENV_CASES.items()}
    cfg = StoreConfig.from_env(env)
    for raw, field, expected in ENV_CASES.values():
        assert getattr(cfg, field) == expected, (field, raw)


def test_from_env_ignores_the_process_environment_when_given_a_mapping(monkeypatch):
    monkeypatch.setenv("HYBRIDSTORE_BLOCK_SIZE", "64")
    assert StoreConfig.from_env({}).block_size == StoreConfig().block_size
    assert StoreConfig.from_env().block_size == 64


def test_from_env_overrides_win_over_the_environment():
    cfg = StoreConfig.from_env({"HYBRIDSTORE_BLOCK_SIZE": "64"}, block_size=8, host_bytes=1 << 20)
    assert (cfg.block_size, cfg.host_bytes) == (8, 1 << 20)


@pytest.mark.parametrize(("raw", "expected"), [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("false", False), ("no", False), ("off", False), ("", False),
])
def test_from_env_reads_booleans(raw, expected):
    cfg = StoreConfig.from_env({"HYBRIDSTORE_PIN_HOST_MEMORY": raw,
                                "HYBRIDSTORE_VERIFY_CHECKSUMS": raw})
    assert cfg.pin_host_memory is expected and cfg.verify_checksums is expected


def test_from_env_reads_floats_and_other_sizes():
    cfg = StoreConfig.from_env({"HYBRIDSTORE_H2D_GBPS": "32.5", "HYBRIDSTORE_SSD_GBPS": "7",
                                "HYBRIDSTORE_DISK_SEGMENT_BYTES": "64MiB",
                                "HYBRIDSTORE_CHECKPOINT_POLICY": "keep-all"})
    assert (cfg.h2d_gbps, cfg.ssd_gbps) == (32.5, 7.0)
    assert cfg.disk_segment_bytes == 64 << 20


def test_from_env_validates_what_it_reads():
    with pytest.raises(ConfigError, match="disk_engine"):
        StoreConfig.from_env({"HYBRIDSTORE_DISK_ENGINE": "nfs"})
    with pytest.raises(ConfigError, match="as a size"):
        StoreConfig.from_env({"HYBRIDSTORE_HOST_BYTES": "lots"})


@pytest.mark.parametrize("variable", ["HYBRIDSTORE_IO_THREADS", "HYBRIDSTORE_H2D_GBPS"])
def test_from_env_a_non_number_raises_config_error(variable):
    with pytest.raises(ConfigError, match=variable):
        StoreConfig.from_env({variable: "eight"})


# -- parse_bytes -------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("4096", 4096), (4096, 4096), ("0", 0), ("12b", 12), ("12B", 12),
    ("1k", 1 << 10), ("1K", 1 << 10), ("1kb", 1000), ("1KiB", 1 << 10),
    ("2m", 2 << 20), ("2MB", 2 * 10**6), ("2mib", 2 << 20),
    ("8g", 8 << 30), ("8GB", 8 * 10**9), ("8GiB", 8 << 30),
    ("1t", 1 << 40), ("1TB", 10**12), ("1TiB", 1 << 40),
    ("512 MB", 512 * 10**6), ("  3 GiB  ", 3 << 30), ("1.5GiB", 3 << 29), ("0.5k", 512),
])
def test_parse_bytes_reads_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "   ", "GiB", "8 XB", "8GiBs", "-1", "-1GiB", "1e3",
                                  "8 GiB extra", "0x10", "1,024", "8 G iB"])
def test_parse_bytes_rejects_what_it_cannot_read(text):
    with pytest.raises(ConfigError, match="as a size") as info:
        parse_bytes(text)
    assert isinstance(info.value, ValueError) and isinstance(info.value, HybridStoreError)


# -- __post_init__ -----------------------------------------------------------------------------

@pytest.mark.parametrize(("changes", "field"), [
    ({"block_size": 0}, "block_size"),
    ({"block_size": (1 << 16) + 1}, "block_size"),
    ({"block_size": "16"}, "block_size"),
    ({"block_size": 16.0}, "block_size"),
    ({"host_bytes": -1}, "host_bytes"),
    ({"host_bytes": 1.5}, "host_bytes"),
    ({"disk_bytes": -1}, "disk_bytes"),
    ({"disk_bytes": "8GiB"}, "disk_bytes"),
    ({"device_bytes": -4096}, "device_bytes"),
    ({"disk_engine": "nfs"}, "disk_engine"),
    ({"tier_policy": "lru"}, "tier_policy"),
    ({"disk_segment_bytes": (1 << 20) - 4096}, "disk_segment_bytes"),
    ({"disk_segment_bytes": (1 << 20) + 1}, "disk_segment_bytes"),
    ({"io_threads": 0}, "io_threads"),
    ({"io_threads": 257}, "io_threads"),
    ({"io_chunk_bytes": 0}, "io_chunk_bytes"),
    ({"io_chunk_bytes": (1 << 20) + 1}, "io_chunk_bytes"),
    ({"io_chunk_bytes": (1 << 30) + 4096}, "io_chunk_bytes"),
    ({"h2d_gbps": 0.0}, "h2d_gbps"),
    ({"ssd_gbps": -1.0}, "ssd_gbps"),
    ({"disk_path": 5}, "disk_path"),
    # issue 13 fuzz: wrong types raised TypeError, NaN and inf were accepted
    ({"block_size": True}, "block_size"),
    ({"disk_segment_bytes": "1MiB"}, "disk_segment_bytes"),
    ({"io_threads": "8"}, "io_threads"),
    ({"io_threads": 1.5}, "io_threads"),
    ({"h2d_gbps": None}, "h2d_gbps"),
    ({"h2d_gbps": float("inf")}, "h2d_gbps"),
    ({"ssd_gbps": float("nan")}, "ssd_gbps"),
    ({"ssd_gbps": [5]}, "ssd_gbps"),
    ({"policy": ["lru"]}, "policy"),
    ({"checkpoint_policy": None}, "checkpoint_policy"),
    ({"namespace": 1.5}, "namespace"),
    ({"pin_host_memory": "no"}, "pin_host_memory"),
    ({"verify_checksums": 0}, "verify_checksums"),
    ({"disk_segment_bytes": 10**30}, "disk_segment_bytes"),      # struct.error at open
])
def test_each_check_raises_config_error(changes, field):
    with pytest.raises(ConfigError, match=field):
        StoreConfig(**changes)
    with pytest.raises(ConfigError, match=field):  # replace() validates again
        StoreConfig().replace(**changes)


@pytest.mark.parametrize("changes", [
    {"block_size": 1}, {"block_size": 1 << 16}, {"host_bytes": 0}, {"device_bytes": 0},
    {"disk_segment_bytes": 1 << 20}, {"io_threads": 1}, {"io_threads": 256},
    {"h2d_gbps": 1e-3}, {"disk_path": "/tmp/hs"}, {"disk_path": None},
    *({"disk_engine": name} for name in DISK_ENGINES),
    *({"tier_policy": name} for name in TIER_POLICY_NAMES),
])
def test_the_edges_of_each_range_are_accepted(changes):
    cfg = StoreConfig(**changes)
    assert all(getattr(cfg, k) == v for k, v in changes.items())


def test_the_config_is_frozen_and_replace_makes_a_copy():
    cfg = StoreConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 32  # type: ignore[misc]
    other = cfg.replace(block_size=32)
    assert (cfg.block_size, other.block_size) == (16, 32)


def test_fields_are_keyword_only():
    with pytest.raises(TypeError):
        StoreConfig(16)  # type: ignore[misc]


def test_tier_policy_names_match_the_registry():
    from hybridstore.policy.tiering import TIER_POLICIES

    assert set(TIER_POLICY_NAMES) == set(TIER_POLICIES)


@pytest.mark.parametrize("secret", [b"short", b"x" * 65, "00" * 32, 12])
def test_a_bad_hash_secret_is_refused(secret) -> None:
    with pytest.raises(ConfigError, match="hash_secret"):
        StoreConfig(hash_secret=secret)


def test_the_hash_secret_never_shows_in_repr() -> None:
    cfg = StoreConfig(hash_secret=b"\x01" * 32)
    assert "hash_secret" not in repr(cfg) and "\\x01" not in repr(cfg)
    with pytest.raises(ConfigError, match="hex"):
        StoreConfig.from_env({"HYBRIDSTORE_HASH_SECRET": "not hex"})
