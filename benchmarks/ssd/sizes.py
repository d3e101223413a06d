"""Object sizes of the SSD benchmark: Qwen3.5-9B's KV block and checkpoint, size lists, labels."""

from __future__ import annotations

__all__ = ["CKPT_BYTES", "FULL_SIZES", "KV_BLOCK_BYTES", "OURS", "QUICK_SIZES", "SIZE_NAMES",
           "TARGET_MIN_BYTES", "TARGET_RATIO", "parse_sizes", "size_label"]

from hybridstore.bench.common import KIB, MIB, fmt_bytes


def _qwen_sizes() -> tuple[int, int]:
    from hybridstore.replay.model_presets import model_preset

    m = model_preset("qwen3.5-9b")
    return m.page_bytes(576), m.checkpoint_bytes


KV_BLOCK_BYTES, CKPT_BYTES = _qwen_sizes()
"""One 576-token KV block and one recurrent-state checkpoint of Qwen3.5-9B (≈ 19.3 MB, 50 MB)."""

FULL_SIZES = (4 * KIB, 64 * KIB, 1 * MIB, 4 * MIB, KV_BLOCK_BYTES, CKPT_BYTES, 64 * MIB, 256 * MIB)
QUICK_SIZES = (4 * KIB, 4 * MIB, KV_BLOCK_BYTES, CKPT_BYTES)
TARGET_MIN_BYTES = 4 * MIB
TARGET_RATIO = 0.9
OURS = "hybridstore-posix"

SIZE_NAMES = {KV_BLOCK_BYTES: "kv-block-576", CKPT_BYTES: "checkpoint"}


def size_label(n: int) -> str:
    """``4 KiB``, ``50000000 B (checkpoint)``..."""
    text = fmt_bytes(n)
    if text.endswith(" B") and n >= MIB:     # not a whole number of units
        text = f"{n / MIB:.1f} MiB"
    name = SIZE_NAMES.get(n)
    return f"{text} ({name})" if name else text


def parse_sizes(text: str) -> list[int]:
    """``"4K,4M,kv,ckpt,1G,12345"`` -> byte counts (``kv``: KV block, ``ckpt``: checkpoint)."""
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        if not p:
            continue
        if p in ("kv", "kv-block"):
            out.append(KV_BLOCK_BYTES)
        elif p in ("ckpt", "checkpoint"):
            out.append(CKPT_BYTES)
        else:
            mult = {"k": KIB, "m": MIB, "g": 1 << 30}.get(p[-1], 1)
            num = p[:-1] if p[-1] in "kmg" else p
            if p.endswith(("kib", "mib", "gib")):
                mult, num = {"kib": KIB, "mib": MIB, "gib": 1 << 30}[p[-3:]], p[:-3]
            out.append(int(float(num) * mult))
        if out[-1] < 1:
            raise ValueError(f"object sizes must be positive: {part!r}")
    return out
