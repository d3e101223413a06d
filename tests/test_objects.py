"""hybridstore.objects.byte_view: the one view of a caller's buffer as flat bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridstore.objects import byte_view


@pytest.mark.parametrize("make", [
    lambda: np.arange(12, dtype=np.float32).reshape(3, 4),
    lambda: torch.arange(12, dtype=torch.float32).reshape(3, 4),
    lambda: torch.arange(24, dtype=torch.int16).view(torch.bfloat16).reshape(2, 12),
    lambda: bytearray(range(48)),
])
def test_views_the_same_bytes_without_copying(make) -> None:
    buf = make()
    raw = bytes(np.asarray(buf).tobytes() if not isinstance(buf, torch.Tensor)
                else buf.view(torch.uint8).numpy().tobytes())
    view = byte_view(buf, writable=True)
    assert view.dtype == np.uint8 and view.ndim == 1 and view.tobytes() == raw
    view[0] ^= 0xFF                                      # a view: the caller's buffer changes
    again = byte_view(buf)
    assert again[0] == raw[0] ^ 0xFF
    assert byte_view(buf, 5).tobytes() == bytes(again[:5])


def test_bad_buffers_get_typed_errors_naming_the_argument() -> None:
    with pytest.raises(TypeError, match="pages is None"):
        byte_view(None, what="pages")
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(np.zeros((4, 4), np.uint8)[:, ::2])
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(torch.zeros(4, 4).t())
    ro = np.zeros(8, np.uint8)
    ro.flags.writeable = False
    assert byte_view(ro).nbytes == 8
    with pytest.raises(ValueError, match="read-only"):
        byte_view(ro, writable=True)
    with pytest.raises(ValueError, match="holds 8 bytes, 9 are needed"):
        byte_view(np.zeros(8, np.uint8), 9, what="out")
    with pytest.raises(ValueError, match="holds 16 bytes"):
        byte_view(torch.zeros(4), 17)
    t = torch.ones(3, requires_grad=True)                # a grad tensor is viewed, not refused
    assert byte_view(t).nbytes == 12
