"""Pseudo token ids for trace requests, derived from their block ids.

Traces carry block ids, not tokens, but the index can match inside a block
when it knows the tokens.  The rule, vectorized (no Python loop per token):

* **full blocks**: block id ``X`` becomes ``block_size`` tokens; the token at
  offset ``j`` is ``hi32(mix64(X * K1 + (j + 1) * K2)) * vocab >> 32`` (a
  SplitMix64 finalizer, scaled into ``[0, vocab)``).  Equal ids give equal
  tokens, different ids different tokens (with overwhelming probability).
* **the tail** (tokens past the last full block, ``input_tokens % block_size``
  of them) is a prefix of a block derived from:

  1. when the next request of the session *continues* this one (same session,
     the same full-block ids, at least as long) and has a full block at that
     index: that block's id, so the tail equals the first tokens the next
     request sends there;
  2. when it continues but ends inside the same block: the next request's own
     tail (with :func:`request_tokens` that is its rule-3/4 tail;
     :func:`session_tokens` follows the whole chain, so every append sees the
     previous request's tokens, tail included, as an exact prefix);
  3. else the request's own partial-block id when it has one (Mooncake);
  4. else the pseudo id ``xxh64("tail", session, index)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache

import numpy as np

from hybridstore.errors import ConfigError
from hybridstore.replay.trace import Request, Session, mix64, salt_of

__all__ = ["DEFAULT_VOCAB", "block_tokens", "request_tokens", "session_tokens"]

#: Qwen vocabulary size.
DEFAULT_VOCAB = 151_936
_K_ID = np.uint64(0x9E3779B97F4A7C15)
_K_OFF = np.uint64(0xD6E8FEB86659FD93)
_S32 = np.uint64(32)


@lru_cache(maxsize=16)
def _offsets(block_size: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        off = np.arange(1, block_size + 1, dtype=np.uint64) * _K_OFF
    off.setflags(write=False)
    return off


def block_tokens(ids: np.ndarray, block_size: int, vocab: int = DEFAULT_VOCAB) -> np.ndarray:
    """Tokens of whole blocks: ``block_size`` per id, concatenated.

    Args:
        ids: uint64 block ids.
        block_size: tokens per block.
        vocab: tokens are in ``[0, vocab)``.

    Returns:
        ``len(ids) * block_size`` uint32 tokens.
    """
    if not 0 < vocab <= 1 << 32:
        raise ConfigError(f"vocab must be in [1, 2**32], got {vocab}")
    ids = np.asarray(ids, dtype=np.uint64)
    x = np.empty((ids.shape[0], block_size), dtype=np.uint64)
    with np.errstate(over="ignore"):
        np.add((ids * _K_ID)[:, None], _offsets(block_size)[None, :], out=x)
        mix64(x)
        x >>= _S32
        x *= np.uint64(vocab)
        x >>= _S32
    return x.astype(np.uint32).reshape(-1)


def _continues(req: Request, nxt: Request | None) -> bool:
    """Whether ``nxt`` keeps all of ``req``'s full blocks and is at least as long."""
    if nxt is None or nxt.session != req.session or nxt.block_size != req.block_size:
        return False
    nf = req.n_full_blocks
    return (nxt.input_tokens >= req.input_tokens and len(nxt.block_ids) >= nf
            and bool(np.array_equal(nxt.block_ids[:nf], req.block_ids[:nf])))


def _own_tail(req: Request, vocab: int) -> np.ndarray:
    nf = req.n_full_blocks
    x = req.block_ids[nf] if req.has_partial_id else salt_of("tail", req.session, req.index)
    return block_tokens(np.array([x], dtype=np.uint64), req.block_size, vocab)[: req.tail_tokens]


def _tail(req: Request, nxt: Request | None, vocab: int, nxt_tail: np.ndarray | None) -> np.ndarray:
    if not _continues(req, nxt):
        return _own_tail(req, vocab)
    assert nxt is not None
    nf = req.n_full_blocks
    if nxt.n_full_blocks > nf:
        return block_tokens(nxt.block_ids[nf:nf + 1], req.block_size, vocab)[: req.tail_tokens]
    if nxt_tail is None:
        nxt_tail = _own_tail(nxt, vocab)
    return nxt_tail[: req.tail_tokens]


def _assemble(req: Request, tail: np.ndarray | None, vocab: int) -> np.ndarray:
    nf, bs = req.n_full_blocks, req.block_size
    out = np.empty(req.input_tokens, dtype=np.uint32)
    out[: nf * bs] = block_tokens(req.block_ids[:nf], bs, vocab)
    if tail is not None:
        out[nf * bs:] = tail
    return out


def request_tokens(req: Request, next_req: Request | None = None,
                   vocab: int = DEFAULT_VOCAB) -> np.ndarray:
    """Deterministic pseudo tokens of one request (see the module docstring).

    Args:
        req: the request.
        next_req: the next request of the same session, if any; it decides
            the tail when it continues ``req``.
        vocab: tokens are in ``[0, vocab)``.

    Returns:
        ``req.input_tokens`` uint32 tokens.
    """
    tail = _tail(req, next_req, vocab, None) if req.tail_tokens else None
    return _assemble(req, tail, vocab)


def session_tokens(session: Session, vocab: int = DEFAULT_VOCAB) -> Iterator[np.ndarray]:
    """Pseudo tokens of every request of a session, in order.

    Tails are resolved backwards along the session first, so whenever a
    request continues the previous one, the previous tokens (tail included)
    are an exact prefix of its tokens.  Only the small tails are held; each
    request's tokens are built when yielded.
    """
    reqs = session.requests
    tails: list[np.ndarray | None] = [None] * len(reqs)
    for i in range(len(reqs) - 1, -1, -1):
        if reqs[i].tail_tokens:
            nxt = reqs[i + 1] if i + 1 < len(reqs) else None
            tails[i] = _tail(reqs[i], nxt, vocab, tails[i + 1] if nxt is not None else None)
    for req, tail in zip(reqs, tails):
        yield _assemble(req, tail, vocab)
