"""The GPU tier: the conformance suite and the side-stream copy (skipped without CUDA)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hybridstore.backends.base import Tier
from hybridstore.errors import ConfigError
from hybridstore.testing.tiers import TierConformance, blob, key_of

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
class TestDeviceTier(TierConformance):
    def make_tier(self, tmp_path: Path, capacity_bytes: int) -> Tier:
        from hybridstore.backends.device import DeviceTier

        return DeviceTier(capacity_bytes, arena_bytes=1 << 20)


@pytest.mark.gpu
@needs_cuda
def test_device_tensors_in_and_out() -> None:
    from hybridstore.backends.device import DeviceTier

    with DeviceTier(4 << 20, arena_bytes=1 << 20) as tier:
        src = torch.arange(5000, dtype=torch.float16, device="cuda")
        tier.put(key_of(1), src, nbytes=10_000).result()
        out = torch.empty_like(src)
        assert tier.get_into(key_of(1), out).result() == 10_000
        assert torch.equal(out, src)


@pytest.mark.gpu
@needs_cuda
def test_copy_to_device_from_a_pinned_pool() -> None:
    from hybridstore.backends.device import copy_to_device
    from hybridstore.backends.host import HostPool

    with HostPool(4 << 20, arena_bytes=1 << 20, pin=True) as pool:
        pool.put(key_of(1), blob(1 << 20, 1), nbytes=1 << 20).result()
        assert pool.is_pinned
        pool.acquire(key_of(1))
        dst = torch.empty(1 << 18, dtype=torch.float32, device="cuda")
        assert copy_to_device(pool.view(key_of(1)), dst).result() is dst
        pool.release_ref(key_of(1))
        got = dst.view(torch.uint8).cpu().numpy()
        assert np.array_equal(got, blob(1 << 20, 1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_no_gpu_is_a_config_error() -> None:
    from hybridstore.backends.device import DeviceTier

    with pytest.raises(ConfigError, match="device_bytes=0"):
        DeviceTier(1 << 20)
