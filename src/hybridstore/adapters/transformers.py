"""Serve a Hugging Face hybrid causal LM with hybridstore as its prefix cache.

:class:`CachedModel` wraps a ``transformers`` causal LM whose cache is the
unified :class:`transformers.DynamicCache` of transformers 5: attention layers
are ``DynamicLayer`` objects (``keys``/``values`` of shape ``[batch, kv_heads,
tokens, head_dim]``), recurrent layers (Gated DeltaNet, Mamba-2, ...) are
``LinearAttentionLayer`` objects (a causal-conv state and a recurrent state per
layer), and hybrid layers such as Falcon-H1's carry both.  Nothing here is
specific to one architecture: the adapter reads the cache object the model
fills, so Qwen3-Next, Falcon-H1 and Mamba-2 go through the same code (Jamba's
Mamba-1 mixers cannot resume a prefill: :data:`MAMBA1_MODEL_TYPES`).

One :meth:`CachedModel.prefill` call does what an engine's scheduler and model
runner do for one request:

1. ``match`` the prompt (capped at ``len - 1`` tokens: the engine must compute
   the last position's logits) — the deepest position ``p`` whose KV pages and
   recurrent-state checkpoint are both held (ARCHITECTURE.md, engine contract);
2. ``load`` the pages and the checkpoint and rebuild the model's cache at ``p``;
3. ask the placement policy where to checkpoint the new segment ``(p, T]``
   (``checkpoint_positions``; request end, HiState's adaptive interval eq. 6,
   FlashStates' request-end + arbitrary positions, semantic anchors ...) and
   prefill in pieces split at those positions, copying the recurrent states out
   after each piece (FlashStates §3: a state exists only at the moment the
   prefill passes its position);
4. ``put_kv_batch`` the new pages (the last one padded to a whole block) and
   ``put_state`` every captured checkpoint.

The result equals a plain forward of the whole prompt up to floating-point
reassociation: splitting a prefill changes the chunk boundaries of the chunked
delta-rule / SSD scans and the length of the attention reductions, so fp32
logits agree to ~1e-6 relative, not bit for bit; the stored bytes themselves
round-trip bit for bit (tests/adapters).

Batch size is one sequence per call; this is the reference adapter that pins
the engine contract down on a real model, not a batched serving loop.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridstore.errors import (BackendIOError, CorruptObjectError, InvalidTokensError,
                                UnsupportedModelError)
from hybridstore.store import HybridStore

__all__ = ["CacheSpec", "CachedModel", "PrefillReport"]

log = logging.getLogger(__name__)

MAX_RESUME_ATTEMPTS = 4
"""Matches tried when a restore hits a corrupt or unreadable object (then: recompute all)."""

MAMBA1_MODEL_TYPES = frozenset({"jamba", "mamba", "falcon_mamba"})
"""Mamba-1 mixers: transformers' multi-token selective scan (and mamba_ssm's
``selective_scan_fn``) starts from a zero state and takes no initial state, so a
prefill of several tokens cannot continue from a checkpoint — only the
one-token decode step reads the cached state.  Resuming these models would
silently compute a different function; the adapter refuses them."""


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor of a page or a checkpoint: which layer, which slot, its shape."""

    name: str
    layer: int
    slot: str            # "k" / "v" for pages, "conv" / "rec" for states
    state_idx: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """What a model's cache holds, per page of ``block_size`` tokens and per checkpoint.

    Built from the cache a one-token forward fills (:meth:`probe`), so it
    follows the model's own cache classes rather than a per-architecture table.

    Attributes:
        block_size: tokens per KV page.
        pages: the tensors of one page: for each attention layer its keys and
            values, ``[kv_heads, block_size, head_dim]`` (for an attention-free
            model, the block's token ids).
        states: the tensors of one checkpoint: for each recurrent layer its
            conv state ``[channels, kernel]`` and recurrent state.
    """

    block_size: int
    pages: tuple[_Entry, ...]
    states: tuple[_Entry, ...]

    @classmethod
    def probe(cls, model: Any, block_size: int) -> CacheSpec:
        """Run one token through ``model`` and read the shapes its cache took."""
        from transformers import DynamicCache
        from transformers.cache_utils import (CacheLayerMixin, DummyLayer,
                                              DynamicSlidingWindowLayer,
                                              LinearAttentionCacheLayerMixin)

        cache = DynamicCache(config=model.config)
        token = torch.zeros((1, 1), dtype=torch.long, device=_device(model))
        with torch.no_grad():
            model(token, cache=cache, use_cache=True, logits_to_keep=1)
        pages: list[_Entry] = []
        states: list[_Entry] = []
        for i, layer in enumerate(cache.layers):
            known = False
            if isinstance(layer, DynamicSlidingWindowLayer):
                raise UnsupportedModelError(
                    f"layer {i} is a sliding-window attention layer ({type(layer).__name__}); its cache "
                    "keeps only the window, so its pages cannot be restored — page the full-attention "
                    "layers of such models with a window-aware adapter")
            if isinstance(layer, CacheLayerMixin) and getattr(layer, "keys", None) is not None:
                _, heads, _, dim = layer.keys.shape
                for slot, t in (("k", layer.keys), ("v", layer.values)):
                    pages.append(_Entry(f"L{i}.{slot}", i, slot, 0, (heads, block_size, dim), t.dtype))
                known = True
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                for j in range(layer.number_of_states):
                    for slot, store in (("conv", layer.conv_states), ("rec", layer.recurrent_states)):
                        t = store.get(j)
                        if t is not None:
                            states.append(_Entry(f"L{i}.{slot}{j}", i, slot, j, tuple(t.shape[1:]), t.dtype))
                known = True
            if not known and not isinstance(layer, DummyLayer):
                raise UnsupportedModelError(
                    f"layer {i} has a cache of type {type(layer).__name__}, which the transformers "
                    "adapter does not know how to page or checkpoint")
        if not pages:
            # attention-free (Mamba-2): a page holds the block's token ids, so the index still has
            # the prefix chain a checkpoint hangs on (and a restore can check the tokens)
            pages.append(_Entry("tokens", -1, "tokens", 0, (block_size,), torch.int32))
        if not states:
            raise UnsupportedModelError(
                "the model has no recurrent layers; a pure-attention model needs no checkpoints — "
                "use an engine's own prefix cache (or only put_kv) for it")
        return cls(block_size=block_size, pages=tuple(pages), states=tuple(states))

    @property
    def state_bytes(self) -> int:
        """Bytes of one checkpoint (all recurrent layers)."""
        return sum(_nbytes(e) for e in self.states)

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes per token (0 for an attention-free model)."""
        kv = sum(_nbytes(e) for e in self.pages if e.slot in ("k", "v"))
        return kv / self.block_size

    def empty_state(self, device: torch.device) -> dict[str, torch.Tensor]:
        """A state buffer for :meth:`HybridStore.load`'s ``into``."""
        return {e.name: torch.empty(e.shape, dtype=e.dtype, device=device) for e in self.states}


@dataclass(frozen=True, slots=True)
class PrefillReport:
    """What one :meth:`CachedModel.prefill` did, measured.

    Attributes:
        tokens: prompt length ``T``.
        reused_tokens: tokens resumed from the store (``p``).
        recomputed_tokens: tokens prefilled (``T - p``).
        checkpoints: positions whose recurrent states were captured and put.
        pages_put: KV pages newly stored.
        restored_bytes: bytes read per tier to resume (``{"host": n, "disk": n}``).
        match_s, load_s, compute_s, put_s: wall seconds of each step.
    """

    tokens: int
    reused_tokens: int
    recomputed_tokens: int
    checkpoints: tuple[int, ...]
    pages_put: int
    restored_bytes: dict[str, int] = field(default_factory=dict)
    match_s: float = 0.0
    load_s: float = 0.0
    compute_s: float = 0.0
    put_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Seconds from the call to the logits being ready, including the puts."""
        return self.match_s + self.load_s + self.compute_s + self.put_s


class CachedModel:
    """A hybrid causal LM whose prefills resume from a :class:`HybridStore`.

    Args:
        model: a ``transformers`` causal LM using the unified ``DynamicCache``
            (Qwen3-Next, Falcon-H1, Mamba-2, ...), in eval mode.
        store: the prefix cache.  Its ``namespace`` must name the model and
            weights: keys are over token ids only, so two models sharing a
            namespace would read each other's states.

    Example::

        store = HybridStore(StoreConfig(block_size=64, namespace="qwen3-next-80b@rev"))
        cm = CachedModel(model, store)
        logits = cm.prefill(prompt_ids)          # [vocab] of the last position
        print(cm.last.reused_tokens, cm.last.recomputed_tokens)

    Raises:
        UnsupportedModelError: the model's cache has layers that cannot be
            paged or checkpointed exactly (sliding-window attention), no
            recurrent layers at all, or Mamba-1 mixers (Jamba; see
            :data:`MAMBA1_MODEL_TYPES`).
    """

    def __init__(self, model: Any, store: HybridStore) -> None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type in MAMBA1_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{model_type!r} uses Mamba-1 mixers whose multi-token scan in transformers takes no "
                "initial state, so a prefill cannot resume from a checkpoint; use a Mamba-2 / Gated "
                "DeltaNet hybrid (Qwen3-Next, Falcon-H1, Mamba-2, Nemotron-H)")
        self.model = model
        self.store = store
        self.last: PrefillReport | None = None
        self._spec: CacheSpec | None = None
        params = inspect.signature(model.forward).parameters
        self._pass_positions = "position_ids" in params

    @property
    def spec(self) -> CacheSpec:
        """The model's page and checkpoint layout (probed on first use)."""
        if self._spec is None:
            self._spec = CacheSpec.probe(self.model, self.store.config.block_size)
        return self._spec

    # -- the engine loop ----------------------------------------------------------------
    def prefill(self, input_ids: Any, *, all_logits: bool = False,
                anchors: Sequence[int] = ()) -> torch.Tensor:
        """Prefill ``input_ids`` resuming from the store; store what it computed.

        Args:
            input_ids: one prompt: a 1-D sequence of token ids (list, numpy,
                tensor) or a ``[1, T]`` tensor.
            all_logits: return the logits of every *computed* position
                (``[T - p, vocab]``, positions ``p..T-1``) instead of the last
                one (``[vocab]``).
            anchors: semantic boundaries of the prompt (message ends, tool
                results) for placements that use them.

        Returns:
            Logits, fp32 as the model computes them.

        Raises:
            InvalidTokensError: an empty prompt, a batch of several prompts, or
                ids outside the model's vocabulary.
        """
        ids = self._token_ids(input_ids)
        T = int(ids.shape[0])
        tokens = ids.cpu().numpy()
        spec = self.spec
        device = _device(self.model)
        t0 = time.perf_counter()
        prompt = self.store.prefix(tokens)
        match_s = time.perf_counter() - t0          # hashing counts as matching
        for _ in range(MAX_RESUME_ATTEMPTS):
            t = time.perf_counter()
            plan = self.store.match(prompt, max_position=T - 1)
            match_s += time.perf_counter() - t
            try:
                p, restored, cache = self._resume(plan, spec, device)
                break
            except (CorruptObjectError, BackendIOError) as e:
                # the store dropped what it could not read; the next match resumes shallower
                log.warning("resume at %d failed (%s); matching again", plan.position, e)
            finally:
                self.store.release(plan)
        else:
            p, restored, cache = 0, {}, self._new_cache()
        t2 = time.perf_counter()
        cuts = sorted({int(q) for q in self.store.checkpoint_positions(cached=p, length=T, anchors=anchors)
                       if p < q <= T})
        bounds = [p, *[q for q in cuts if q < T], T]
        outputs: list[torch.Tensor] = []
        snapshots: dict[int, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            for a, b in zip(bounds[:-1], bounds[1:]):
                logits = self._forward(ids[a:b], cache, start=a,
                                       keep=(b - a) if all_logits else 1)
                if all_logits:
                    outputs.append(logits[0])
                elif b == T:
                    outputs.append(logits[0, -1])
                if b in cuts:
                    snapshots[b] = self._snapshot(cache)
        t3 = time.perf_counter()
        pages_put = self._put(prompt, ids, cache, p, T, snapshots)
        t4 = time.perf_counter()
        self.last = PrefillReport(tokens=T, reused_tokens=p, recomputed_tokens=T - p,
                                  checkpoints=tuple(cuts), pages_put=pages_put,
                                  restored_bytes=restored, match_s=match_s, load_s=t2 - t0 - match_s,
                                  compute_s=t3 - t2, put_s=t4 - t3)
        return torch.cat(outputs, 0) if all_logits else outputs[-1]

    def reference(self, input_ids: Any, *, all_logits: bool = False) -> torch.Tensor:
        """A plain forward of the whole prompt with no cache (what prefill must equal)."""
        ids = self._token_ids(input_ids)
        with torch.no_grad():
            logits = self.model(ids[None], logits_to_keep=0 if all_logits else 1).logits
        return logits[0] if all_logits else logits[0, -1]

    # -- pieces -----------------------------------------------------------------------
    def _resume(self, plan: Any, spec: CacheSpec,
                device: torch.device) -> tuple[int, dict[str, int], Any]:
        """Load ``plan`` into a fresh model cache; returns ``(p, bytes per tier, cache)``."""
        cache = self._new_cache()
        p = plan.position
        if not p:
            return 0, {}, cache
        restored = {tier: n for tier, (n, _) in self.store.restore_cost(plan).items()}
        npages = len(plan.pages)
        stage = {e.name: torch.empty((npages, *e.shape), dtype=e.dtype, device=device)
                 for e in spec.pages}
        state = spec.empty_state(device)
        self.store.load(plan, into=(stage, state)).result()     # a page-major batch
        self._restore(cache, stage, state, p)
        return p, restored, cache

    def _token_ids(self, input_ids: Any) -> torch.Tensor:
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.as_tensor(np.asarray(input_ids))
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise InvalidTokensError(
                    f"CachedModel.prefill takes one prompt; got a batch of {ids.shape[0]} — call it per sequence")
            ids = ids[0]
        if ids.dim() != 1 or ids.numel() == 0:
            raise InvalidTokensError(f"expected a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise InvalidTokensError(f"token ids must be integers, got {ids.dtype}")
        vocab = int(getattr(self.model.config, "vocab_size", 0) or 0)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or (vocab and hi >= vocab):
            raise InvalidTokensError(f"token ids must be in [0, {vocab}); got values in [{lo}, {hi}]")
        return ids.to(dtype=torch.long, device=_device(self.model))

    def _new_cache(self) -> Any:
        from transformers import DynamicCache
        return DynamicCache(config=self.model.config)

    def _forward(self, ids: torch.Tensor, cache: Any, *, start: int, keep: int) -> torch.Tensor:
        kwargs: dict[str, Any] = {"cache": cache, "use_cache": True, "logits_to_keep": keep}
        if self._pass_positions:
            kwargs["position_ids"] = torch.arange(start, start + ids.shape[0], device=ids.device)[None]
        return self.model(ids[None], **kwargs).logits

    def _restore(self, cache: Any, stage: dict[str, torch.Tensor],
                 state: dict[str, torch.Tensor], p: int) -> None:
        """Rebuild the model's cache at position ``p`` from loaded pages and a checkpoint."""
        spec = self.spec
        for e in spec.pages:
            if e.slot != "k":                      # one (k, v) pair per attention layer
                continue
            k, v = stage[f"L{e.layer}.k"], stage[f"L{e.layer}.v"]
            # page-major [n, H, B, D] -> the layer's [1, H, n*B, D], cut to p tokens
            keys = k.permute(1, 0, 2, 3).reshape(k.shape[1], -1, k.shape[3])[:, :p]
            values = v.permute(1, 0, 2, 3).reshape(v.shape[1], -1, v.shape[3])[:, :p]
            cache.layers[e.layer].update(keys[None], values[None])
        for e in spec.states:
            layer = cache.layers[e.layer]
            src = state[e.name][None]
            if e.slot == "conv":
                layer.lazy_initialization(conv_states=src, state_idx=e.state_idx,
                                          conv_kernel_size=src.shape[-1])
                layer.conv_states[e.state_idx].copy_(src)
            else:
                layer.lazy_initialization(recurrent_states=src, state_idx=e.state_idx)
                layer.recurrent_states[e.state_idx].copy_(src)
            layer.has_previous_state[e.state_idx] = True

    def _snapshot(self, cache: Any) -> dict[str, torch.Tensor]:
        """Copy every recurrent layer's states out of the cache (they change in place)."""
        out = {}
        for e in self.spec.states:
            layer = cache.layers[e.layer]
            src = layer.conv_states if e.slot == "conv" else layer.recurrent_states
            out[e.name] = src[e.state_idx][0].clone()
        return out

    def _put(self, prompt: Any, ids: torch.Tensor, cache: Any, p: int, T: int,
             snapshots: dict[int, dict[str, torch.Tensor]]) -> int:
        """Put the pages from the block holding ``p`` to the end, then the checkpoints.

        The pages go as one page-major batch (:meth:`HybridStore.put_kv_batch`):
        per cache tensor one padded copy ``[pages, *page shape]`` in host memory
        (one device-to-host copy per tensor; no second copy of the KV on the
        GPU), which the store scatters into its pool slots a run at a time.
        """
        spec = self.spec
        B = spec.block_size
        first, nblocks = p // B, -(-T // B)
        n = nblocks - first
        batch = {}
        for e in spec.pages:
            lo, hi = first * B, T
            if e.slot == "tokens":
                rows = torch.zeros((n * B,) + e.shape[1:], dtype=e.dtype)
                rows[: hi - lo] = ids[lo:hi].to(e.dtype).cpu()
                batch[e.name] = rows.view(n, *e.shape)
                continue
            layer = cache.layers[e.layer]
            src = (layer.keys if e.slot == "k" else layer.values)[0, :, lo:hi]   # [heads, t, dim]
            heads, _, dim = src.shape
            rows = torch.zeros((heads, n * B, dim), dtype=e.dtype)
            rows[:, : hi - lo] = src          # one device-to-host copy per tensor
            batch[e.name] = rows.view(heads, n, B, dim).transpose(0, 1).contiguous()
        stored = self.store.put_kv_batch(prompt, batch) if n > 0 else 0
        for q in sorted(snapshots):
            self.store.put_state(prompt, snapshots[q], position=q)
        return stored


def _nbytes(e: _Entry) -> int:
    return int(np.prod(e.shape)) * torch.empty((), dtype=e.dtype).element_size()


def _device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")
