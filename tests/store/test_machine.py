"""The whole store under random operations (accounting tiers: sizes, real index and
policies): put/match/release/evict in any order never breaks refcounts, plans or the
per-tier byte counts."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridstore import CapacityError, HybridStore, StoreConfig
from hybridstore.backends.accounting import AccountingTier


class StoreMachine(RuleBasedStateMachine):
    """put/match/release/evict in any order never breaks refcounts or plans."""

    def __init__(self) -> None:
        super().__init__()
        tiers = {"host": AccountingTier("host", 40 * 100, read_gbps=64),
                 "disk": AccountingTier("disk", 80 * 100, read_gbps=5)}
        self.store = HybridStore(StoreConfig(block_size=4, tier_policy="write-back"), tiers=tiers)
        self.plans = []

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=24), data=st.data())
    def put(self, tokens, data):
        prompt = self.store.prefix(tokens)
        first = data.draw(st.integers(0, prompt.nblocks - 1))
        try:
            self.store.put_kv_sized(prompt, nbytes=100, first_block=first)
            self.store.put_state_sized(prompt, nbytes=300, position=data.draw(
                st.integers(1, prompt.length)))
        except CapacityError:
            pass                                  # everything pinned: allowed, nothing broken

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=24))
    def match(self, tokens):
        plan = self.store.match(tokens)
        if plan.position:
            assert plan.state_key is not None and self.store.index.checkpoint(plan.state_key).tiers
            for key in plan.page_keys:
                assert self.store.index.page_info(self.store.index.find_node(key))["tiers"]
            cost = self.store.restore_cost(plan)
            assert sum(n for n, _ in cost.values()) == 100 * len(plan.page_keys) + 300
        self.plans.append(plan)

    @precondition(lambda self: self.plans)
    @rule(data=st.data())
    def release(self, data):
        self.store.release(self.plans.pop(data.draw(st.integers(0, len(self.plans) - 1))))

    @rule(tier=st.sampled_from(["host", "disk"]), nbytes=st.integers(1, 4000))
    def evict(self, tier, nbytes):
        self.store.evict(nbytes, tier=tier)

    @invariant()
    def consistent(self):
        assert self.store.index.check_refcounts()
        for name, tier in self.store.tiers.items():
            assert tier.used_bytes <= tier.capacity_bytes
            held = sum(tier.nbytes(k) for k, _, _ in tier.entries())
            assert held == sum(self.store._res.kind_bytes[name].values())

    def teardown(self):
        self.store.close()


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
