"""A text corpus that does not change with the code: a 256 KiB snapshot of this package's source
(``infinity.models.data.text_corpus()`` as of 2026-12-04), committed beside this module.

``text_corpus()`` reads the package's current source, so a test that trains on it draws other
batches after every commit: a bounded comparison of two trainings (quantized against exact
collectives) then moves with unrelated edits, and a change that should not alter its result
can move it past its bound (a 40-step sample ranged -0.4% to +2.05% across commits). Tests that
compare trainings read this file instead."""

from __future__ import annotations

from pathlib import Path

import torch

_PATH = Path(__file__).with_name("text_corpus.txt")


def fixed_text_corpus() -> torch.Tensor:
    """The snapshot's bytes (uint8)."""
    return torch.frombuffer(bytearray(_PATH.read_bytes()), dtype=torch.uint8).clone()
