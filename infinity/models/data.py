"""Training data that ships with the project: its own source and docs as byte-level text.

``text_corpus()`` concatenates the package's ``.py`` files and the README (when present) into one
uint8 tensor (vocabulary 256); ``text_batch`` cuts deterministic random windows out of it. Real
text has structure a small GPT learns within a few dozen steps, so the main job's loss falls
visibly, unlike uniform random tokens.
"""

from __future__ import annotations

import pathlib

import torch

VOCAB_SIZE = 256
_ROOT = pathlib.Path(__file__).resolve().parents[1]


def text_corpus() -> torch.Tensor:
    files = sorted(_ROOT.rglob("*.py"))
    readme = _ROOT.parent / "README.md"
    if readme.exists():
        files.append(readme)
    data = b"\n".join(p.read_bytes() for p in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def text_batch(corpus: torch.Tensor, batch_size: int, seq_len: int, *, seed: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` windows of ``seq_len + 1`` bytes at seeded random offsets: (inputs, targets)."""
    if corpus.numel() <= seq_len + 1:
        raise ValueError(f"corpus of {corpus.numel()} bytes is too short for seq_len {seq_len}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch_size,), generator=g)
    windows = torch.stack([corpus[s:s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
