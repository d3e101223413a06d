"""``StoreConfig.remote``: the URL that names a remote tier, parsed once.

``mooncake://HOST:PORT[?key=value&...]`` names a Mooncake Store master (its RPC
port, ``mooncake_master --rpc_port``).  The query keys, all optional:

====================  ==========================================  ===============
key                   meaning                                     default
====================  ==========================================  ===============
``prefix``            name prefix of every object this store      ``hybridstore``
                      puts (tenants sharing a master use their
                      own; stores that must share objects, the
                      same one)
``metadata``          the transfer engine's metadata service      ``P2PHANDSHAKE``
                      (``P2PHANDSHAKE``: none; or
                      ``http://HOST:PORT/metadata`` of the
                      master's ``--enable_http_metadata_server``)
``protocol``          ``tcp`` (``rdma`` where there is a NIC)     ``tcp``
``device``            RDMA device names (``""`` for tcp)          ``""``
``hostname``          this client's address as others reach it    ``127.0.0.1``
``segment``           bytes of memory this process lends to the   ``256MiB``
                      pool (objects live in lenders' segments;
                      ``0``: none, a ``mooncake_client`` lends)
``buffer``            the client's local transfer buffer          ``128MiB``
``staging``           registered staging arena of this tier       ``64MiB``
``timeout``           seconds any one call may take before the    ``5``
                      tier counts the master as down
``retry``             seconds a down master is left alone before  ``5``
                      the next attempt
====================  ==========================================  ===============
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from hybridstore.errors import ConfigError
from hybridstore.units import parse_bytes

SCHEMES = ("mooncake",)


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteSpec:
    """A parsed remote URL (see the module table)."""

    scheme: str
    host: str
    port: int
    prefix: str = "hybridstore"
    metadata: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device: str = ""
    hostname: str = "127.0.0.1"
    segment_bytes: int = 256 << 20
    buffer_bytes: int = 128 << 20
    staging_bytes: int = 64 << 20
    timeout_s: float = 5.0
    retry_s: float = 5.0

    @property
    def master(self) -> str:
        """``HOST:PORT`` of the master."""
        return f"{self.host}:{self.port}"


_SIZES = {"segment": "segment_bytes", "buffer": "buffer_bytes", "staging": "staging_bytes"}
_SECONDS = {"timeout": "timeout_s", "retry": "retry_s"}
_TEXT = {"prefix": "prefix", "metadata": "metadata", "protocol": "protocol", "device": "device",
         "hostname": "hostname"}


def parse_remote(url: str) -> RemoteSpec:
    """Parse ``StoreConfig.remote``.

    Raises:
        ConfigError: not a ``mooncake://HOST:PORT`` URL, an unknown query key, or a
            value out of range.
    """

    if not isinstance(url, str):
        raise ConfigError(f"remote must be a URL string like 'mooncake://127.0.0.1:50051', got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ConfigError(f"remote {url!r}: the scheme must be one of {SCHEMES} "
                          "(e.g. 'mooncake://127.0.0.1:50051')")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ConfigError(f"remote {url!r} must name the master as mooncake://HOST:PORT "
                          "(the port of mooncake_master --rpc_port)")
    kwargs: dict[str, object] = {}
    for key, values in parse_qs(parts.query, keep_blank_values=True).items():
        value = values[-1]
        if key in _SIZES:
            kwargs[_SIZES[key]] = parse_bytes(value)
        elif key in _SECONDS:
            try:
                kwargs[_SECONDS[key]] = float(value)
            except ValueError:
                raise ConfigError(f"remote {url!r}: {key}={value!r} is not a number of seconds") from None
        elif key in _TEXT:
            kwargs[_TEXT[key]] = value
        else:
            raise ConfigError(f"remote {url!r}: unknown option {key!r}; options are "
                              f"{sorted([*_SIZES, *_SECONDS, *_TEXT])}")
    spec = RemoteSpec(scheme=parts.scheme, host=parts.hostname, port=port, **kwargs)  # type: ignore[arg-type]
    if spec.timeout_s <= 0 or spec.retry_s < 0:
        raise ConfigError(f"remote {url!r}: timeout must be > 0 and retry >= 0 seconds")
    if spec.staging_bytes < (1 << 20) or spec.buffer_bytes < (1 << 20) or \
            0 < spec.segment_bytes < (1 << 20):
        raise ConfigError(f"remote {url!r}: buffer and staging must be at least 1 MiB, segment "
                          "0 (lend nothing: objects live in other processes' segments) or at "
                          "least 1 MiB")
    if not spec.prefix or any(c in spec.prefix for c in " \n\0"):
        raise ConfigError(f"remote {url!r}: prefix must be non-empty, without spaces")
    return spec
