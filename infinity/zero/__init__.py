"""ZeRO stages 0-3 and the training engine: the only package that touches module hooks and autograd.

``initialize(model, config)`` composes everything into the :class:`InfinityEngine`: the parameter
manager (units, flat groups, shards, hooks, gather/release, gradient reduction) over the
collectives, the shard optimizer of :mod:`infinity.optim`, the tiered store of :mod:`infinity.tiers`
with the trace-driven prefetcher of :mod:`infinity.prefetch`, and checkpoints. ``init(config)``
builds a model larger than memory (recorded on meta, materialised unit by unit).
"""

from infinity.zero._activations import apply_activation_checkpointing
from infinity.zero._collectives import CollectiveError, Collectives, barrier, init_distributed
from infinity.zero._device import resolve_device
from infinity.zero._engine import InfinityEngine
from infinity.zero._initialize import initialize, pipeline_stage_of_rank
from infinity.zero._flat_group import Unit, UnitState, UnitUse
from infinity.zero._lazy import LazyInitError, extend_recording, init
from infinity.zero._managed import engine_of
from infinity.zero._mesh import MeshRanks, mesh_ranks
from infinity.zero._offload import host_needs_of, least_host_budget_bytes
from infinity.zero._param_manager import ParameterManager
from infinity.zero._unit_builder import BuildProgress

__all__ = ["BuildProgress", "CollectiveError", "Collectives", "InfinityEngine", "LazyInitError",
           "MeshRanks", "ParameterManager", "Unit", "UnitState", "UnitUse",
           "apply_activation_checkpointing", "barrier", "engine_of", "extend_recording",
           "host_needs_of", "init", "init_distributed", "initialize", "least_host_budget_bytes",
           "mesh_ranks", "pipeline_stage_of_rank", "resolve_device"]
