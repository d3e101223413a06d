"""One error hierarchy for hybridstore.

Every error the library raises on purpose derives from :class:`HybridStoreError`.
Where a builtin exception already describes the failure, the class also
subclasses it (``ValueError``, ``OSError``, ...), so callers that catch the
builtin keep working.  Messages say what was wrong *and* how to fix it.

A call that raises one of these errors has changed nothing already stored.
"""

from __future__ import annotations


class HybridStoreError(Exception):
    """Base class of every error raised by hybridstore."""


class ConfigError(HybridStoreError, ValueError):
    """A :class:`~hybridstore.config.StoreConfig` field is out of range."""


class MisalignedPageError(HybridStoreError, ValueError):
    """A KV page was offered for a prefix that does not end a block.

    A page must end at a multiple of ``block_size`` or be the final partial
    page of the given token sequence.
    """


class InvalidArgumentError(HybridStoreError, ValueError, TypeError):
    """An argument of the wrong type or out of range (a position, a count, a plan).

    Both a ``ValueError`` and a ``TypeError``, so callers that catch either keep
    working.
    """


class InvalidTokensError(InvalidArgumentError):
    """Token ids (or block ids) that are not a 1-D sequence of ids in [0, 2**32)."""


class UnknownPrefixError(InvalidTokensError):
    """Engine page keys whose chain from position 0 is neither given nor known to the store.

    An engine hands the store chained page hashes (SGLang, vLLM); a page's place
    in its sequence comes from the keys before it (``prefix``) or, when those
    are not passed, from the index, which knows it only for pages it holds.
    """


class NamespaceError(HybridStoreError, PermissionError):
    """A prompt or a disk directory that belongs to another namespace (tenant).

    The namespace salts every key; a store enforces it: it opens only a disk
    directory recorded with its own namespace, and takes only prompts hashed
    under its own root.
    """


class UnknownTierError(HybridStoreError, KeyError):
    """A tier name that this store does not have."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class CapacityError(HybridStoreError, MemoryError):
    """An object does not fit in a tier, even after eviction."""


class DiskFullError(CapacityError):
    """The file system under the disk tier is full (``ENOSPC``/``EDQUOT``) before the
    tier's budget is: the store makes room on the tier as for any full tier, or the
    object is not written there."""


class ObjectTooLargeError(CapacityError):
    """An object is larger than a tier's whole budget (or its largest slot)."""


class LayoutMismatchError(HybridStoreError, TypeError):
    """A page or state whose dtype/shape contradicts the store's layout."""


class StoreClosedError(HybridStoreError, RuntimeError):
    """The store (or one of its tiers) was used after ``close()``."""


class DiskPathError(HybridStoreError, OSError):
    """``disk_path`` cannot be created, written, locked or opened."""


class CatalogError(HybridStoreError, OSError):
    """The durable lmdb catalog is unreadable or was written by another format."""


class CorruptObjectError(HybridStoreError):
    """An object's bytes failed their checksum, or cannot be read back (they lie past the
    end of a truncated file, or the device keeps failing the read), even when read again:
    it is dropped, never returned.

    Attributes:
        key: the object's key.
        expected: the checksum recorded in the catalog.
        got: the checksum of the bytes read back (``None`` when they could not be read).
    """

    def __init__(self, message: str, *, key: bytes | None = None,
                 expected: int | None = None, got: int | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.expected = expected
        self.got = got


class UnauthenticValueError(CorruptObjectError):
    """A remote value whose seal (a MAC keyed by the store's hash secret and namespace)
    does not verify: damaged, written by another tenant, or forged by a client of the
    shared pool.  It is a miss, never returned."""


class BackendIOError(HybridStoreError, OSError):
    """A read or write of a tier failed.

    Attributes:
        key: the object's key (or ``None``).
        offset: the file offset of the failed I/O (or ``None``).
        expected: how many bytes the I/O should have moved.
        got: how many it moved.
    """

    def __init__(self, message: str, *, key: bytes | None = None, offset: int | None = None,
                 expected: int | None = None, got: int | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.offset = offset
        self.expected = expected
        self.got = got


class PlanReleasedError(HybridStoreError, RuntimeError):
    """A :class:`~hybridstore.index.ResumePlan` was used after ``release()``."""


class UnsupportedModelError(HybridStoreError, TypeError):
    """A model whose cache an adapter cannot page and checkpoint exactly.

    For example a sliding-window attention layer (its cache drops tokens, so a
    page of it cannot be restored) or a cache layer type the adapter does not
    know.
    """


class MissingExtraError(HybridStoreError, ImportError):
    """A command or adapter needs a package that only one of the install extras brings.

    The store itself needs numpy, torch, lmdb and xxhash; ``hybridstore replay``,
    ``demo`` and ``bench core`` need ``[replay]``, the transformers adapter ``[hf]``.
    """

    extra: str = ""
    """The extra that brings the missing module."""

    EXTRAS = {"zstandard": "replay", "tqdm": "replay", "rich": "replay",
              "matplotlib": "replay", "transformers": "hf"}
    """The top-level module each extra brings, by module name."""

    @classmethod
    def of(cls, exc: ModuleNotFoundError) -> MissingExtraError | None:
        """The typed error for ``exc`` when an extra brings its module, else None."""
        module = (exc.name or "").partition(".")[0]
        extra = cls.EXTRAS.get(module)
        if extra is None:
            return None
        err = cls(f"{module} is not installed: pip install 'hybridstore[{extra}]' "
                  f"(from a clone: pip install -e '.[{extra}]')", name=module)
        err.extra = extra
        return err


__all__ = [
    "BackendIOError",
    "CapacityError",
    "CatalogError",
    "ConfigError",
    "CorruptObjectError",
    "DiskPathError",
    "HybridStoreError",
    "InvalidTokensError",
    "LayoutMismatchError",
    "MisalignedPageError",
    "MissingExtraError",
    "ObjectTooLargeError",
    "PlanReleasedError",
    "StoreClosedError",
    "UnauthenticValueError",
    "UnknownTierError",
    "UnsupportedModelError",
]
