"""What the vLLM preset takes from vLLM's one block pool beyond its order: a state charged
as vLLM pads it (``Preset.vllm_blocks``), and second copies of recomputed KV
(``Preset.duplicates``, ``sim.put_duplicates``): its block pool does not de-duplicate, so a
prefill resumed before the end of the cached KV caches those blocks twice; the
content-addressed store models the second copy as a branch no prompt reaches."""

from __future__ import annotations

import numpy as np
import pytest

from hybridstore.errors import ConfigError, InvalidTokensError
from hybridstore.replay.loaders import load
from hybridstore.replay.model_presets import model_preset, vllm_hybrid_pages
from hybridstore.replay.planes import SizedObjects
from hybridstore.replay.samples import weka_sample
from hybridstore.replay.sim import (
    ReplayConfig,
    _cached_past,
    build_store,
    put_duplicates,
    replay,
)
from hybridstore.replay.systems import Preset, preset

B = 64


@pytest.fixture
def store():
    model = model_preset("qwen3.5-9b")
    s = build_store(preset("vllm-marconi"), ReplayConfig(), model, B)
    yield s, model.page_bytes(B)
    s.close()


def _prompt(store, ids):
    return store.prefix_from_block_ids(np.asarray(ids, dtype=np.int64), length=len(ids) * B)


def test_a_resume_before_the_cached_kv_end_stores_the_recomputed_blocks_again(store):
    s, page = store
    objects = SizedObjects()
    first = _prompt(s, range(1, 9))                       # 8 blocks, a state after block 2
    objects.put_pages(s, first, 0, page)
    objects.put_state(s, first, 2 * B, 50_000_000)
    second = _prompt(s, [1, 2, 3, 4, 5, 6, 100, 101])     # shares 6 blocks, no state at 6
    plan = s.match(second)
    assert (plan.position, plan.kv_tokens) == (2 * B, 6 * B)
    s.release(plan)
    tier = s.tiers["device"]
    before = tier.used_bytes
    cached = _cached_past(s, second, plan.position)           # blocks 3..6, before the put
    objects.put_pages(s, second, plan.position // B, page)   # the engine's own put
    assert tier.used_bytes - before == 2 * page               # blocks 7, 8: new
    copied = put_duplicates(s, objects, second, plan.position, cached, page, serial=1)
    assert copied == 4                                        # blocks 3..6 cached twice
    assert tier.used_bytes - before == 6 * page + 1           # and a one-byte marker state
    # the copies are invisible to lookups: the same resume point, the same pages
    again = s.match(second)
    assert (again.position, again.kv_tokens) == (2 * B, 8 * B)
    s.release(again)
    # another request's copies of the same blocks are other objects
    assert put_duplicates(s, objects, second, plan.position, cached, page, serial=2) == 4
    assert tier.used_bytes - before == 10 * page + 2
    # nothing to copy: a resume at the end of the cached KV, or past it
    assert put_duplicates(s, objects, second, 6 * B, cached[4:], page, serial=3) == 0
    assert put_duplicates(s, objects, second, 2 * B, cached[:0], page, serial=4) == 0


def test_the_copies_rank_as_the_older_copy_and_free_their_room(store):
    """The copies rank as the older copy they stand for (last used before the engine's put
    touched it): after the KV no state needs (which vLLM never caches, so ``lru-vllm``
    offers it first), before a prompt used after that older copy; and their bytes come
    back when they go."""
    s, page = store
    objects = SizedObjects()
    first = _prompt(s, range(1, 9))                       # every page needed: a state at 8
    objects.put_pages(s, first, 0, page)
    objects.put_state(s, first, 2 * B, 50_000_000)
    objects.put_state(s, first, 8 * B, 50_000_000)
    other = _prompt(s, range(300, 304))                   # used after the first prompt
    objects.put_pages(s, other, 0, page)
    objects.put_state(s, other, 4 * B, 50_000_000)
    second = _prompt(s, [1, 2, 3, 4, 5, 6, 100, 101])     # resumes at 2, KV cached to 6
    last_used = _cached_past(s, second, 2 * B)
    assert 2 + len(last_used) == 6 and len(last_used) == 4
    objects.put_pages(s, second, 2, page)                 # touches 3..6, adds 7, 8 (no state)
    assert put_duplicates(s, objects, second, 2 * B, last_used, page, serial=1) == 4
    tier = s.tiers["device"]
    used = tier.used_bytes
    # six pages of room: the second prompt's tail (no state needs it), then what was last
    # used with the first prompt: its own tail and the copies, which rank as its blocks
    # did before the second prompt touched them; the prompt used after it stays
    s.evict(6 * page, tier="device")
    assert tier.used_bytes == used - 6 * page
    assert s.present_pages(other) == 4 and s.present_pages(first) == 6
    # they are not kept for ever: room for all but the newest objects takes them too
    s.evict(tier.used_bytes - 1, tier="device")
    assert tier.used_bytes < page


def test_aging_pages_the_index_does_not_know_is_refused(store):
    s, _ = store
    with pytest.raises(InvalidTokensError):
        s.age_sized(_prompt(s, range(500, 504)), first_block=0, last_used=[0, 0])


def test_a_vllm_state_takes_a_hybrid_block_in_each_mamba_group():
    """qwen3.5-9b: 3 Mamba groups of 512-token blocks of 17.2 MB: 51.6 MB for a 50 MB state;
    our own store charges the state's bytes.  vLLM's pool is whole blocks less block 0."""
    model = model_preset("qwen3.5-9b")
    pages = vllm_hybrid_pages(model)
    assert preset("vllm-marconi").state_bytes(model) == round(3 * pages.block_bytes)
    assert model.checkpoint_bytes < preset("vllm-marconi").state_bytes(model) < 1.05 * model.checkpoint_bytes
    assert preset("hybridstore").state_bytes(model) == model.checkpoint_bytes
    small = model.with_state_scale(0.5)                 # the block follows the state
    # the pool: whole blocks, less the null block; at a quarter scale the same blocks
    assert preset("vllm-marconi").pool_bytes(model, 100 * pages.block_bytes + 5) == \
        int(99 * pages.block_bytes)
    assert preset("vllm-marconi").pool_bytes(model, 25 * pages.block_bytes, scale=4) == \
        int(99 * pages.block_bytes / 4)
    assert preset("vllm-marconi").pool_bytes(model, pages.block_bytes // 2) == 0
    assert preset("hybridstore").pool_bytes(model, 12345) == 12345
    # while it prefills: the partial last block and two running states (3 blocks each)
    assert preset("vllm-marconi").transient_bytes(model) == round(7 * pages.block_bytes)
    assert preset("hybridstore").transient_bytes(model) == 0
    assert preset("vllm-marconi").state_bytes(small) == round(3 * vllm_hybrid_pages(small).block_bytes)


def test_duplicates_model_one_gpu_pool_only():
    with pytest.raises(ConfigError, match="one GPU block pool"):
        Preset(name="x", eviction="lru-vllm", placement=lambda m, b: None,  # type: ignore[arg-type,return-value]
               tiers=("device", "host"), duplicates=True)


@pytest.mark.parametrize("state_scale", [1.0, 0.02])
def test_the_replay_counts_the_copies_of_the_preset_that_makes_them(state_scale):
    """Also where vLLM's hybrid block (16 tokens at 1 MB states) is smaller than a page."""
    trace = load(str(weka_sample()))
    cfg = ReplayConfig(discipline="sequential", budget=0.5, max_requests=120,
                       state_scale=state_scale)
    runs = replay(trace, ["vllm-marconi", "hybridstore"], cfg, progress=False)
    assert runs["vllm-marconi"].summary()["duplicated_pages"] > 0
    assert runs["hybridstore"].summary()["duplicated_pages"] == 0


def test_aged_pages_go_first_in_a_tier_that_reuses_its_ranking(store):
    """A tier of more than ``REUSE_RANKING_OBJECTS`` objects reuses one ranking for several
    evictions, which does not have pages put since; aging makes the next one afresh."""
    from hybridstore.store.evictor import REUSE_RANKING_OBJECTS

    s, page = store
    objects = SizedObjects()
    n = REUSE_RANKING_OBJECTS // 16 + 1
    prompts = [_prompt(s, range(1000 * k, 1000 * k + 16)) for k in range(n)]
    for p in prompts:
        objects.put_pages(s, p, 0, page)
    s.evict(page, tier="device")              # makes a ranking the next evictions reuse
    late = _prompt(s, range(99_000, 99_004))
    objects.put_pages(s, late, 0, page)
    s.age_sized(late, first_block=0, last_used=[0] * 4)   # before anything else
    s.evict(4 * page, tier="device")
    assert s.present_pages(late) == 0         # the aged prompt went, not the ranked ones
    assert sum(s.present_pages(p) for p in prompts) == n * 16 - 1


def test_a_prefill_makes_room_for_the_blocks_it_holds_only_while_it_runs():
    """vLLM's pool holds the prompt's partial last block and two running states while it
    prefills: the preset's KV allocation makes room for them too, so an idle prompt that
    would fit beside the new segment alone is evicted."""
    from hybridstore.replay.sim import _allocate

    model = model_preset("qwen3.5-9b")
    page = model.page_bytes(B)
    transient = preset("vllm-marconi").transient_bytes(model)
    for extra, kept in ((0, 8), (transient, 0)):
        cfg = ReplayConfig(gpu_gib=(16 * page + transient) / 2**30)
        s = build_store(preset("vllm-marconi"), cfg, model, B)
        objects = SizedObjects()
        idle = _prompt(s, range(1, 9))
        objects.put_pages(s, idle, 0, page)
        new = _prompt(s, range(100, 108))
        _allocate(s, new, 0, page, extra)
        assert s.present_pages(idle) == kept
        s.close()
