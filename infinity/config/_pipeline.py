"""The ``pipeline`` section: how a pipeline-parallel step runs its micro-batches (the number of
stages is the mesh's ``pipeline`` dimension, [Note: mesh dimensions] in infinity/config/_mesh.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from infinity.config._checks import AUTO, check_choice, check_float, check_int

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
"""``torch.distributed.pipelining``'s schedules by their native names."""


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """``pipeline``: the schedule of a pipeline-parallel engine (:mod:`infinity.pipeline`)."""

    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = "1f1b"
    """'gpipe': every micro-batch's forward, then every backward (m micro-batches' activations
    held); '1f1b': one forward one backward after the warm-up (at most P held on the first
    stage); 'interleaved-1f1b': ``stages_per_rank`` model chunks per rank, a smaller bubble. The
    bubble of the first two is (P - 1) / (m + P - 1) of a step."""
    micro_batches: int | Literal["auto"] = AUTO
    """Micro-batches per optimizer step (m); 'auto': ``gradient_accumulation_steps`` (DeepSpeed's
    pipeline engine reads it so). The schedule splits each batch given to ``train_batch`` into
    m along its first dimension."""
    stages_per_rank: int = 1
    """Model chunks each rank holds (interleaved-1f1b: 2 or more; the others: 1)."""
    max_stage_imbalance: float = 1.5
    """The most a stage's bytes (its states in the ledger) may exceed the balanced split's largest
    stage when the split is given (``split_points``); a larger one is refused, naming the stage."""

    def __post_init__(self) -> None:
        check_choice("pipeline.schedule", self.schedule, SCHEDULES)
        check_int("pipeline.micro_batches", self.micro_batches, minimum=1, allow_auto=True)
        check_int("pipeline.stages_per_rank", self.stages_per_rank, minimum=1)
        check_float("pipeline.max_stage_imbalance", self.max_stage_imbalance, minimum=1.0)
        if (self.stages_per_rank > 1) != (self.schedule == "interleaved-1f1b"):
            raise ValueError(f"pipeline.stages_per_rank: {self.stages_per_rank} with schedule "
                             f"{self.schedule!r}; interleaved-1f1b takes 2 or more chunks per "
                             f"rank, the other schedules 1")

    def resolve_micro_batches(self, gradient_accumulation_steps: int) -> int:
        return (gradient_accumulation_steps if self.micro_batches == AUTO
                else int(self.micro_batches))
