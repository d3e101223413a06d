"""Checkpoint placement: intervals, HiState's adaptive interval (eq. 3–6), anchors, unions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hybridstore import ConfigError, HybridStore, StoreConfig
from hybridstore.backends.accounting import AccountingTier
from hybridstore.objects import ObjectKind
from hybridstore.policy import (
    AdaptiveInterval,
    BlockAligned,
    BranchPoints,
    Compose,
    FixedInterval,
    RequestEnd,
    ResidenceStats,
    SemanticAnchors,
    placement_policy,
)
from hybridstore.policy.intervals import (
    best_interval,
    continuous_interval,
    memory_cost,
    recompute_cost,
)

HISTATE_BLOCK = 576   # HiState's evaluation block size (tokens)


def stats(ratio: float) -> ResidenceStats:
    s = ResidenceStats()
    s.observe(ObjectKind.STATE, 1000.0)
    s.observe(ObjectKind.PAGE, 1000.0 * ratio)
    return s


# -- eq. 3–6 ---------------------------------------------------------------------------
@pytest.mark.parametrize("L,I", [(1000, 1), (1000, 7), (1000, 256), (1000, 1000), (1000, 4096), (4096, 64)])
def test_eq3_closed_sum_equals_the_literal_sum(L, I):
    literal = sum(t - I * (t // I) for t in range(1, L)) / L
    assert recompute_cost(L, I) == pytest.approx(literal)


def test_eq4_storage_scales_with_checkpoints_and_residence_ratio():
    assert memory_cost(8192, 1024, 100.0, 1.0) == pytest.approx(800.0)
    assert memory_cost(8192, 1024, 100.0, 2.0) == pytest.approx(1600.0)


@pytest.mark.parametrize("N_s", [16, 64])
@pytest.mark.parametrize("ratio", [0.25, 1.0, 4.0])
def test_eq6_closed_form_agrees_with_eq5_argmin_within_a_grid_step(N_s, ratio):
    """On HiState's 576-token block grid, for a long segment (L >> I*)."""
    L = 1 << 20
    grid = np.arange(HISTATE_BLOCK, L + 1, HISTATE_BLOCK)
    discrete = best_interval(L, grid, N_s, ratio)
    closed = continuous_interval(L, N_s, ratio)
    assert closed == pytest.approx(math.sqrt(2 * L * N_s * ratio))
    assert abs(discrete - closed) <= HISTATE_BLOCK


@pytest.mark.parametrize("L", [1 << 15, 1 << 17, 1 << 20])
@pytest.mark.parametrize("N_s", [64, 512, 1560])
@pytest.mark.parametrize("ratio", [0.25, 1.0, 4.0])
def test_eq6_is_near_optimal_for_eq5_on_a_fine_grid(L, N_s, ratio):
    """On a 16-token grid eq. 3's partial last cycle (at most ~I²/8L tokens, which eq. 6
    drops) makes the argmin wobble around eq. 6 by about I*·sqrt(I*/4L) tokens; the cost
    surface is flat there, so eq. 6 rounded to the grid costs within I*/4L of the optimum."""
    grid = np.arange(16, L + 1, 16)
    closed = continuous_interval(L, N_s, ratio)
    total = memory_cost(L, grid, N_s, ratio) + recompute_cost(L, grid)
    at_closed = total[int(np.argmin(np.abs(grid - closed)))]
    assert at_closed <= total.min() * (1 + closed / (4 * L))
    discrete = best_interval(L, grid, N_s, ratio)
    assert abs(discrete - closed) <= 16 + closed * math.sqrt(closed / (4 * L))


def test_adaptive_interval_grows_with_segment_length_and_residence_ratio():
    policy = AdaptiveInterval(state_bytes=1024 * 100, kv_bytes_per_token=100, block_size=16)
    by_length = [policy.interval(L) for L in (4096, 32768, 262144)]
    assert by_length == sorted(by_length) and len(set(by_length)) == 3
    by_ratio = [policy.interval(65536, r) for r in (0.25, 1.0, 4.0)]
    assert by_ratio == sorted(by_ratio) and len(set(by_ratio)) == 3
    # the same through positions(): a larger T_KV/T_state spaces checkpoints further apart
    dense = policy.positions(cached=0, length=65536, stats=stats(0.25))
    sparse = policy.positions(cached=0, length=65536, stats=stats(4.0))
    assert len(dense) > len(sparse) > 1


def test_adaptive_positions_are_block_aligned_steps_of_I_star_then_the_end():
    policy = AdaptiveInterval(state_bytes=1024 * 100, kv_bytes_per_token=100, block_size=16)
    cached, length = 1000, 1000 + 40_000 + 7
    I = policy.interval(length - cached)
    pos = policy.positions(cached=cached, length=length)
    assert pos[-1] == length
    inner = pos[:-1]
    assert inner and all(p % 16 == 0 and cached < p < length for p in inner)
    assert all(I - 16 < b - a <= I + 16 for a, b in zip(inner, inner[1:]))
    assert len(inner) == (length - cached) // I


def test_adaptive_keeps_only_the_end_of_a_short_segment():
    policy = AdaptiveInterval()
    assert policy.positions(cached=100, length=300) == [300]
    assert policy.positions(cached=300, length=300) == []


def test_store_passes_its_residence_stats_to_the_placement():
    policy = AdaptiveInterval(state_bytes=1024 * 100, kv_bytes_per_token=100, block_size=16)
    store = HybridStore(StoreConfig(block_size=16),
                        tiers={"host": AccountingTier("host", 1 << 20, read_gbps=64)}, placement=policy)
    store.residence.observe(ObjectKind.STATE, 10.0)
    store.residence.observe(ObjectKind.PAGE, 40.0)
    got = store.checkpoint_positions(cached=0, length=65536)
    assert got == policy.positions(cached=0, length=65536, stats=stats(4.0))


# -- the other placements ------------------------------------------------------------------
def test_fixed_interval_is_every_multiple_in_the_new_segment():
    assert FixedInterval().positions(cached=300, length=1100) == [512, 768, 1024]
    assert FixedInterval(interval=100, end=True).positions(cached=0, length=250) == [100, 200, 250]
    assert FixedInterval(interval=100, end=True).positions(cached=0, length=200) == [100, 200]


def test_block_aligned_keeps_chunk_ends_and_the_last_block_boundary():
    assert BlockAligned(block_size=16).positions(cached=0, length=1000) == [992]
    assert BlockAligned(block_size=16, chunk=256).positions(cached=32, length=1000) == [288, 544, 800, 992]
    # vLLM recomputes a prompt's last token for its logits: a whole-block prompt keeps its
    # state one block earlier, and a prompt ending a token past a boundary keeps it there
    assert BlockAligned(block_size=16, logits_token=True).positions(cached=0, length=992) == [976]
    assert BlockAligned(block_size=16, logits_token=True).positions(cached=0, length=993) == [992]
    assert BlockAligned(block_size=16, logits_token=True).positions(cached=976, length=992) == []
    assert BlockAligned(block_size=16).positions(cached=992, length=1000) == []   # ASC would keep 1000


def test_request_end_is_flashstates_exact_end():
    assert RequestEnd().positions(cached=100, length=1003) == [1003]


def test_marconi_keeps_the_request_end_and_the_branch_point():
    policy = BranchPoints()
    assert policy.positions(cached=128, length=900, branch=600) == [600, 900]
    assert policy.positions(cached=600, length=900, branch=600) == [900]   # state exists already
    assert policy.positions(cached=128, length=900, anchors=[600]) == [600, 900]


def test_semantic_anchors_inside_the_new_segment():
    policy = SemanticAnchors()
    anchors = [50, 100, 420, 777, 1000, 1200]
    assert policy.positions(cached=100, length=1000, anchors=anchors) == [420, 777, 1000]
    assert SemanticAnchors(end=True).positions(cached=100, length=1000, anchors=[420]) == [420, 1000]


def test_compose_takes_the_union():
    policy = Compose(FixedInterval(interval=256), SemanticAnchors(), RequestEnd())
    assert policy.positions(cached=0, length=700, anchors=[300, 512]) == [256, 300, 512, 700]
    assert policy.name == "interval+anchors+request-end"


def test_placement_registry():
    assert isinstance(placement_policy("interval", interval=64), FixedInterval)
    composed = placement_policy("adaptive+anchors")
    assert isinstance(composed, Compose) and composed.name == "adaptive+anchors"
    with pytest.raises(ConfigError, match="choose one of"):
        placement_policy("every-token")
    with pytest.raises(ConfigError, match="bad parameters"):
        placement_policy("interval", every=3)
    with pytest.raises(ConfigError, match="takes no parameters"):
        placement_policy("adaptive+anchors", block_size=16)
