"""CachedModel on real transformers hybrid architectures (CPU, random weights).

What is asserted:

* prompts mutated the ways agents mutate them (HiState §2.2: append,
  mid-message truncation, rewind and edit, compaction) give the logits of a
  plain forward of the whole prompt, within fp32 reassociation error (bound
  below), and resume exactly where a brute-force model of the store says;
* every page and checkpoint that went through DRAM and disk comes back
  bit-identical to the tensors the model computed;
* a store reopened by a new process resumes from a disk checkpoint;
* bad input gets a typed error and changes nothing.

Tolerance: resuming splits the prefill at the checkpoint, which moves the
chunk boundaries of the chunked Gated-DeltaNet / Mamba-2 scans and shortens
the attention reductions, so fp32 results differ by reassociation only.  The
bound held is ``|logits - reference| <= 2e-5 * max(1, max|reference|)``
(measured: <= 4e-7 for Qwen3-Next and Falcon-H1, <= 2.2e-6 for Mamba-2 whose
logits reach 5).  A wrong state or a misplaced page shows as errors of 1e-2 or
more.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from hybridstore import (HybridStore, InvalidTokensError, LayoutMismatchError, StoreConfig,  # noqa: E402
                         UnsupportedModelError)
from hybridstore.adapters.hf_models import small_model  # noqa: E402
from hybridstore.adapters.transformers import CachedModel  # noqa: E402
from hybridstore.policy import Compose, FixedInterval, RequestEnd, SemanticAnchors  # noqa: E402

VOCAB = 1024
BLOCK = 16
ARCHS = ["qwen3-next", "falcon-h1", "mamba2"]


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return small_model(request.param, vocab=VOCAB)


@pytest.fixture(scope="module")
def qwen():
    return small_model("qwen3-next", vocab=VOCAB)


def _store(tmp_path: Path, *, placement=None, host_bytes: int = 64 << 20, **kw) -> HybridStore:
    cfg = StoreConfig(block_size=BLOCK, host_bytes=host_bytes, disk_path=str(tmp_path / "ssd"),
                      disk_bytes=512 << 20, **kw)
    return HybridStore(cfg, placement=placement)


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    bound = 2e-5 * max(1.0, float(ref.abs().max()))
    err = float((out - ref).abs().max())
    assert err <= bound, f"max |logits - reference| = {err:.3g} > {bound:.3g}"


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if len(diff) else n


def _conversation(seed: int = 7) -> list[tuple[str, np.ndarray, list[int]]]:
    """One agent session: (what changed, prompt, message boundaries)."""
    rng = np.random.default_rng(seed)

    def msg(n: int) -> np.ndarray:
        return rng.integers(1, VOCAB, n)

    marker = np.array([0])                      # the omission marker; random tokens are >= 1
    sys_p, user1, asst1, tool1, user2 = msg(70), msg(90), msg(40), msg(150), msg(40)
    t1 = np.concatenate([sys_p, user1])
    t2 = np.concatenate([t1, asst1, tool1])
    t3 = np.concatenate([t1, asst1, tool1[:61], marker, tool1[-30:], user2])     # mid-message truncation
    t4 = np.concatenate([sys_p, user1[:50], msg(60)])                            # rewind and edit
    t5 = np.concatenate([sys_p, msg(80), msg(40)])                               # compaction
    t6 = np.concatenate([t3, msg(35)])                                           # append after the cut
    bounds = lambda *parts: list(np.cumsum([len(p) for p in parts]))  # noqa: E731
    return [("first turn", t1, bounds(sys_p, user1)),
            ("append tool result", t2, bounds(sys_p, user1, asst1, tool1)),
            ("mid-message truncation", t3, bounds(sys_p, user1, asst1)),
            ("rewind and edit", t4, bounds(sys_p)),
            ("compaction", t5, bounds(sys_p)),
            ("append", t6, bounds(t3))]


def test_agent_mutations_equal_full_forward(model, tmp_path):
    """Every turn's logits equal a full forward; reuse equals the brute-force answer."""
    placement = Compose(RequestEnd(), FixedInterval(interval=48), SemanticAnchors())
    with _store(tmp_path, placement=placement) as store:
        cm = CachedModel(model, store)
        kept: list[tuple[np.ndarray, int]] = []         # (prompt, checkpoint position) put so far
        reused_any = []
        for what, prompt, anchors in _conversation():
            T = len(prompt)
            expected = max([q for seen, q in kept if q <= T - 1 and q <= _lcp(seen, prompt)], default=0)
            out = cm.prefill(prompt, all_logits=True, anchors=anchors)
            rep = cm.last
            assert rep.reused_tokens == expected, what
            assert rep.recomputed_tokens == T - expected
            assert out.shape == (T - expected, VOCAB)
            _assert_close(out, cm.reference(prompt, all_logits=True)[expected:])
            _assert_close(cm.prefill(prompt), cm.reference(prompt))   # same prompt again: last position
            assert cm.last.reused_tokens == max([q for q in rep.checkpoints if q <= T - 1], default=expected)
            assert T in rep.checkpoints and all(expected < q <= T for q in rep.checkpoints)
            # checkpoints inside the new segment, not only at its end (the placement asked for them)
            assert set(rep.checkpoints) >= {q for q in range(expected + 1, T) if q % 48 == 0}
            kept += [(prompt, q) for q in rep.checkpoints]
            reused_any.append(expected)
        # the truncation and the rewind resumed inside earlier messages, not at a turn's end
        assert reused_any[2] > len(_conversation()[0][1]) and reused_any[3] > 70


def test_fresh_prefill_is_bit_identical_to_plain_forward(qwen, tmp_path):
    with _store(tmp_path) as store:
        cm = CachedModel(qwen, store)
        prompt = np.random.default_rng(1).integers(1, VOCAB, 200)
        assert torch.equal(cm.prefill(prompt), cm.reference(prompt))
        assert cm.last.reused_tokens == 0 and cm.last.checkpoints == (200,)


class _Recorder:
    """Keep a copy of every page and state the adapter hands the store, by key."""

    def __init__(self, store: HybridStore) -> None:
        self.pages: dict[bytes, dict[str, torch.Tensor]] = {}
        self.states: dict[bytes, dict[str, torch.Tensor]] = {}
        put_kv, put_kv_batch, put_state = store.put_kv, store.put_kv_batch, store.put_state

        def record(tokens, pages):
            prompt = store.prefix(tokens)
            first = prompt.nblocks - len(pages)
            for i, page in enumerate(pages):
                self.pages.setdefault(prompt.block_key(first + i),
                                      {k: v.detach().clone() for k, v in page.items()})

        def rec_kv(tokens, pages):
            record(tokens, pages)
            return put_kv(tokens, pages)

        def rec_kv_batch(tokens, batch, *, count=None):
            n = count or len(next(iter(batch.values())))
            record(tokens, [{k: v[i] for k, v in batch.items()} for i in range(n)])
            return put_kv_batch(tokens, batch, count=count)

        def rec_state(tokens, state, *, position=None):
            prompt = store.prefix(tokens)
            self.states[prompt.key_at(position)] = {k: v.detach().clone() for k, v in state.items()}
            return put_state(tokens, state, position=position)

        store.put_kv, store.put_kv_batch, store.put_state = rec_kv, rec_kv_batch, rec_state


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].contiguous().view(torch.uint8).flatten(),
                                                 b[k].contiguous().view(torch.uint8).flatten())
        for k in a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_and_states_round_trip_dram_and_disk(tmp_path, dtype):
    model = small_model("qwen3-next", vocab=VOCAB, dtype=dtype)
    with _store(tmp_path, placement=Compose(RequestEnd(), FixedInterval(interval=40))) as store:
        rec = _Recorder(store)
        cm = CachedModel(model, store)
        turns = _conversation()
        for _, prompt, anchors in turns:
            cm.prefill(prompt, anchors=anchors)
        store.flush()
        for source in ("host", "disk"):
            if source == "disk":                    # drop every DRAM copy; the SSD tier still has them
                store.evict(1 << 40, "host")
            for _, prompt, _ in turns:
                plan = store.match(prompt)
                try:
                    assert plan.position == len(prompt)
                    assert set(store.restore_cost(plan)) == {source}
                    pages, state = store.load(plan).result()
                    for key, page in zip(plan.page_keys, pages):
                        assert _same_bits(page, rec.pages[key])
                    assert _same_bits(state, rec.states[plan.state_key])
                finally:
                    store.release(plan)


_CHILD = textwrap.dedent("""
    import json, sys, numpy as np, torch
    from hybridstore import HybridStore, StoreConfig
    from hybridstore.adapters.hf_models import small_model
    from hybridstore.adapters.transformers import CachedModel
    disk, out = sys.argv[1], sys.argv[2]
    prompt = np.random.default_rng(3).integers(1, 1024, 230)
    store = HybridStore(StoreConfig(block_size=16, host_bytes=64 << 20, disk_path=disk, disk_bytes=512 << 20))
    captured = {}
    put_state = store.put_state
    def keep(tokens, state, *, position=None):
        captured.update({k: v.clone() for k, v in state.items()})
        return put_state(tokens, state, position=position)
    store.put_state = keep
    cm = CachedModel(small_model("qwen3-next", vocab=1024), store)
    cm.prefill(prompt)
    store.close()
    torch.save(captured, out)
""")


def test_resume_from_disk_after_reopen_in_new_process(qwen, tmp_path):
    disk, saved = tmp_path / "ssd", tmp_path / "state.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", _CHILD, str(disk), str(saved)], check=True, env=env,
                   timeout=300)
    first = np.random.default_rng(3).integers(1, VOCAB, 230)
    prompt = np.concatenate([first, np.random.default_rng(4).integers(1, VOCAB, 50)])
    with HybridStore(StoreConfig(block_size=BLOCK, host_bytes=64 << 20, disk_path=str(disk),
                                 disk_bytes=512 << 20)) as store:
        plan = store.match(first)
        try:
            assert plan.position == 230 and set(store.restore_cost(plan)) == {"disk"}
            _, state = store.load(plan).result()
        finally:
            store.release(plan)
        assert _same_bits(state, torch.load(saved))
        cm = CachedModel(qwen, store)
        out = cm.prefill(prompt)
        assert cm.last.reused_tokens == 230 and cm.last.recomputed_tokens == 50
        assert set(cm.last.restored_bytes) == {"disk"} and cm.last.restored_bytes["disk"] > 0
        _assert_close(out, cm.reference(prompt))


@pytest.mark.parametrize("bad", [
    torch.zeros((2, 8), dtype=torch.long),            # a batch
    torch.zeros(0, dtype=torch.long),                 # empty
    torch.full((8,), VOCAB, dtype=torch.long),        # outside the vocabulary
    torch.full((8,), -1, dtype=torch.long),
    torch.zeros(8, dtype=torch.float32),              # not ids
])
def test_bad_prompts_raise_typed_errors_and_change_nothing(qwen, tmp_path, bad):
    with _store(tmp_path, placement=Compose(RequestEnd(), FixedInterval(interval=16))) as store:
        cm = CachedModel(qwen, store)
        cm.prefill(np.arange(1, 40))
        before = store.stats()
        with pytest.raises(InvalidTokensError):
            cm.prefill(bad)
        after = store.stats()
        assert {k: v for k, v in after.items() if k != "tiers"} == {k: v for k, v in before.items() if k != "tiers"}
        assert cm.prefill(np.arange(1, 40)) is not None and cm.last.reused_tokens == 32


def test_models_the_adapter_cannot_resume_are_refused(tmp_path):
    import transformers as tf

    with _store(tmp_path) as store:
        with pytest.raises(UnsupportedModelError, match="Mamba-1"):
            CachedModel(small_model("jamba", vocab=VOCAB), store)
        llama = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                   num_hidden_layers=2, num_attention_heads=2,
                                                   num_key_value_heads=1)).eval()
        with pytest.raises(UnsupportedModelError, match="no recurrent layers"):
            CachedModel(llama, store).prefill(np.arange(1, 10))


def test_two_models_in_one_namespace_get_a_layout_error_not_wrong_bytes(qwen, tmp_path):
    prompt = np.random.default_rng(5).integers(1, VOCAB, 120)
    with _store(tmp_path) as store:
        cm = CachedModel(qwen, store)
        cm.prefill(prompt)
        other = CachedModel(small_model("falcon-h1", vocab=VOCAB), store)
        with pytest.raises(LayoutMismatchError):
            other.prefill(prompt)                     # would restore qwen's pages into falcon's cache
        with pytest.raises(LayoutMismatchError):
            other.prefill(prompt[::-1].copy())        # would put falcon pages into qwen's layout
        _assert_close(cm.prefill(prompt, all_logits=True), cm.reference(prompt, all_logits=True))
        # the only checkpoint is at the request end (120): resending the same prompt must still
        # compute position 119's logits, so it resumes from nothing
        assert cm.last.reused_tokens == 0


def test_a_corrupt_checkpoint_on_disk_falls_back_to_a_shallower_resume(qwen, tmp_path):
    """A flipped byte in the deepest checkpoint: typed drop in the store, exact logits anyway."""
    from hybridstore.backends.disk import segment_name
    from hybridstore.objects import ObjectKind, object_key

    first = np.random.default_rng(8).integers(1, VOCAB, 200)
    prompt = np.concatenate([first, np.random.default_rng(9).integers(1, VOCAB, 40)])
    with _store(tmp_path, placement=Compose(RequestEnd(), FixedInterval(interval=64))) as store:
        cm = CachedModel(qwen, store)
        cm.prefill(first)                                   # checkpoints at 64, 128, 192, 200
        store.flush()
        store.evict(1 << 40, "host")
        disk = store.tiers["disk"]
        rec = disk.catalog.get(object_key(ObjectKind.STATE, store.prefix(first).key_at(200)))
        with open(tmp_path / "ssd" / segment_name(rec.segment), "r+b") as fh:
            fh.seek(rec.offset + 100)
            byte = fh.read(1)
            fh.seek(rec.offset + 100)
            fh.write(bytes([byte[0] ^ 0xFF]))
        out = cm.prefill(prompt)
        assert cm.last.reused_tokens == 192                 # the next checkpoint down
        assert store.stats()["corrupt"] == 1
        _assert_close(out, cm.reference(prompt))
