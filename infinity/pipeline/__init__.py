"""Pipeline parallelism composed with ZeRO and offload (``mesh.pipeline`` stages, each an
:class:`~infinity.zero.InfinityEngine` over its own layers and ranks; the schedule is
``torch.distributed.pipelining``'s): [Note: ZeRO inside a pipeline stage] in
infinity/pipeline/_engine.py, [Note: the pipeline split] in infinity/pipeline/_split.py."""

from infinity.pipeline._engine import PipelineEngine, initialize, initialize_stage
from infinity.pipeline._split import (StageSplit, balanced_split, check_split, check_stage_bytes,
                                      child_costs)

__all__ = ["PipelineEngine", "StageSplit", "balanced_split", "check_split", "check_stage_bytes",
           "child_costs", "initialize", "initialize_stage"]
