"""How one object is laid out as a Mooncake value, its name there, and its seal.

A value is a 68-byte header, the object's opaque ``meta``, then its payload::

    magic "HSR2" | version u16 | flags u16 | meta_len u32 | nbytes u64 |
    name tag 8 B | layout 8 B | seal 32 B

Every value is sealed by a :class:`Sealer`, whose keys are derived from the store's
hash secret and its tenant (the namespace root): ``seal`` is the HMAC-SHA256 of the
value's Mooncake name and of everything before and after it (the header's other
fields, the meta and the payload); with ``flags & ENCRYPTED`` the payload is its
AES-256-GCM ciphertext instead (same length) and ``seal`` holds the 12-byte nonce and
the 16-byte GCM tag, the name and header its associated data.  ``name tag`` (a keyed
hash of the name) lets a header be rejected before its payload is read, and
``layout`` names the tensor layout the payload was written with.

A value written under another name, by another tenant or secret, with another
layout, by another version, cut short, or changed in any byte fails :meth:`Sealer.open`
(a :class:`~hybridstore.errors.UnauthenticValueError`) and is a miss, never returned.
Names are ``PREFIX/KEYHEX`` (the 17-byte :data:`~hybridstore.objects.ObjectKey` in hex)
and ``PREFIX/info/TENANT/NAME`` for :meth:`~hybridstore.backends.base.Tier.put_info`
blobs, ``TENANT`` a keyed id of the tenant (so that tenants sharing a prefix each
keep their own layout records).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import Any

import numpy as np

from hybridstore.errors import MissingExtraError, UnauthenticValueError

MAGIC = b"HSR2"
VERSION = 2
ENCRYPTED = 1
HEADER = struct.Struct("<4sHHIQ8s8s32s")
HEADER_BYTES = HEADER.size            # 68
SEAL_AT = HEADER_BYTES - 32
MAX_META = 0xFFFF
NO_LAYOUT = bytes(8)


def object_name(prefix: str, key: bytes) -> str:
    """The Mooncake name of an object."""
    return f"{prefix}/{key.hex()}"


def layout_tag(layout_json: bytes | None) -> bytes:
    """The 8-byte id of a recorded layout (:data:`NO_LAYOUT` for none)."""
    if layout_json is None:
        return NO_LAYOUT
    return hashlib.blake2b(layout_json, digest_size=8, person=b"hs-layout").digest()


def _aesgcm() -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as e:
        err = MissingExtraError("remote_encrypt=True needs the 'cryptography' package: pip "
                                "install 'hybridstore[remote-encrypt]' (or: pip install "
                                "cryptography)", name="cryptography")
        err.extra = "remote-encrypt"
        raise err from e
    return AESGCM


class Sealer:
    """Seals and opens the values of one tenant (see the module docstring).

    Args:
        secret: the store's hash secret (16 to 64 bytes); values sealed under another
            one never open.
        tenant: the store's namespace root (values of another namespace never open).
        encrypt: encrypt payloads (AES-256-GCM; needs ``cryptography``).

    Raises:
        MissingExtraError: ``encrypt`` without the ``cryptography`` package.
    """

    def __init__(self, secret: bytes, tenant: bytes, *, encrypt: bool = False) -> None:
        def derive(person: bytes, size: int = 32) -> bytes:
            return hashlib.blake2b(tenant, key=secret, person=person, digest_size=size).digest()

        self._mac_key = derive(b"hs-remote-mac")
        self.tenant_id = derive(b"hs-remote-id", 12).hex()
        self.encrypt = encrypt
        self._enc_key = derive(b"hs-remote-enc")
        self._aead = _aesgcm()(self._enc_key) if encrypt else None

    def info_name(self, prefix: str, name: str) -> str:
        """The Mooncake name of this tenant's info blob ``name``."""
        return f"{prefix}/info/{self.tenant_id}/{name}"

    def _name_tag(self, name: str) -> bytes:
        return hashlib.blake2b(name.encode(), key=self._mac_key, digest_size=8).digest()

    def _mac(self, name: str, head: bytes, meta: bytes, payload: Any) -> bytes:
        h = hmac.new(self._mac_key, name.encode() + b"\0" + head[:SEAL_AT], "sha256")
        h.update(meta)
        h.update(payload)
        return h.digest()

    def seal(self, name: str, meta: bytes, layout: bytes,
             payload: np.ndarray) -> tuple[bytes, np.ndarray]:
        """``(header + meta, body)`` of the value of ``payload`` (a uint8 array) under
        ``name``: ``body`` is ``payload`` itself, or its ciphertext."""
        if len(meta) > MAX_META:
            raise ValueError(f"meta of {len(meta)} bytes is longer than {MAX_META}")
        n = int(payload.nbytes)
        flags = ENCRYPTED if self._aead is not None else 0
        head = HEADER.pack(MAGIC, VERSION, flags, len(meta), n, self._name_tag(name), layout,
                           bytes(32))
        if self._aead is None:
            seal = self._mac(name, head, meta, payload)
            body = payload
        else:
            nonce = os.urandom(12)
            out = self._aead.encrypt(nonce, payload.tobytes(), self._aad(name, head, meta))
            body = np.frombuffer(out, np.uint8)[:n]
            seal = nonce + out[n:] + bytes(4)
        return head[:SEAL_AT] + seal + meta, body

    @staticmethod
    def _aad(name: str, head: bytes, meta: bytes) -> bytes:
        return name.encode() + b"\0" + head[:SEAL_AT] + meta

    def parse(self, name: str, head: np.ndarray | bytes) -> tuple[int, int, bytes]:
        """``(meta_len, nbytes, layout)`` of a value's first :data:`HEADER_BYTES`, before
        its payload is read (the seal itself is checked by :meth:`open`).

        Raises:
            UnauthenticValueError: not a value of this version sealed by this tenant
                under ``name``.
        """
        raw = bytes(head[:HEADER_BYTES])
        if len(raw) < HEADER_BYTES:
            raise UnauthenticValueError(f"remote value {name}: {len(raw)} bytes, shorter than "
                                        "a header")
        magic, version, _, meta_len, nbytes, tag, layout, _ = HEADER.unpack(raw)
        if magic != MAGIC or version != VERSION or \
                not hmac.compare_digest(tag, self._name_tag(name)):
            raise UnauthenticValueError(f"remote value {name} is not a hybridstore v{VERSION} "
                                        "value this tenant wrote under this name (another "
                                        "secret, namespace or version, or forged)")
        return meta_len, nbytes, layout

    def open(self, name: str, value: np.ndarray) -> tuple[bytes, bytes, np.ndarray]:
        """Verify a whole value; ``(meta, layout, payload)`` (the payload a view of
        ``value``, or its decrypted copy).

        Raises:
            UnauthenticValueError: a wrong header, size or seal.
        """
        meta_len, nbytes, layout = self.parse(name, value)
        start = HEADER_BYTES + meta_len
        if value.nbytes != start + nbytes:
            raise UnauthenticValueError(f"remote value {name} is {value.nbytes} bytes, its "
                                        f"header says {start + nbytes}")
        head = bytes(value[:HEADER_BYTES])
        meta = bytes(value[HEADER_BYTES:start])
        body = value[start:]
        flags = HEADER.unpack(head)[2]
        if flags & ENCRYPTED:
            aead = self._aead if self._aead is not None else _aesgcm()(self._enc_key)
            try:
                plain = aead.decrypt(head[SEAL_AT:SEAL_AT + 12],
                                     body.tobytes() + head[SEAL_AT + 12:SEAL_AT + 28],
                                     self._aad(name, head, meta))
            except Exception:   # cryptography's InvalidTag
                raise UnauthenticValueError(f"remote value {name} failed its seal "
                                            "(AES-GCM tag)") from None
            return meta, layout, np.frombuffer(plain, np.uint8)
        if not hmac.compare_digest(self._mac(name, head, meta, body), head[SEAL_AT:]):
            raise UnauthenticValueError(f"remote value {name} failed its seal (HMAC-SHA256): "
                                        "damaged or forged")
        return meta, layout, body
