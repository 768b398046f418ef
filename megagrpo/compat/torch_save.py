"""``torch.save`` without the CRC32 it computes of every record.

Verified with torch 2.13.0. ``torch.save`` computes a CRC32 of every record it writes (~0.15 s per
GB per checkpoint writer) that ``torch.load`` never checks; the switch is torch's own
(``torch.utils.serialization.config.save.compute_crc32``). Restored on exit; where a torch
version lacks the switch, nothing changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def without_crc32() -> Iterator[None]:
    try:
        from torch.utils.serialization import config as ser_config

        save_config = ser_config.save
        before = save_config.compute_crc32
    except (ImportError, AttributeError):
        save_config = None
    if save_config is None:
        yield
        return
    save_config.compute_crc32 = False
    try:
        yield
    finally:
        save_config.compute_crc32 = before
