"""Checkpoints and weights: save and load the full training state at any world size, consolidate a
save into one state dict, load Hugging Face safetensors straight into the shards.

- :mod:`._save` / :mod:`._load`: a manifest plus per-unit shard files per rank, written atomically
  ([Note: crash safety]), loadable at another world size, stage or unit choice
  ([Note: ranges per parameter] in :mod:`._layout`); every rank validates before anything changes
  (:mod:`._ranks`).
- :mod:`._reader`: the manifest and range reads of a save, with no engine and no process group.
- :mod:`._consolidate`: one HF-style state dict from a save, one parameter in memory at a time.
- :mod:`._weights`: ``engine.load_weights``: safetensors (file, directory, sharded index) read by
  byte range into each rank's partition ([Note: each rank reads its partition]).

- :mod:`._target`: :class:`CheckpointTarget`, all that saves and loads read from and write to the
  training state ([Note: what a checkpoint touches] in :mod:`._target`); the engine hands one out
  (``engine.checkpoint_view()``). The public functions take the engine as before; it imports
  nothing of ``zero`` and walks none of the engine's parts.

Module DAG inside the package: ``_reader``, ``_target`` <- ``_layout``, ``_ranks``, ``_rng`` <-
``_save``, ``_load``, ``_weights``; ``_reader`` <- ``_consolidate``.
"""

from infinity.checkpoint._consolidate import (DEFAULT_MAX_SHARD_BYTES, OUT_DTYPES,
                                              ConsolidateResult, consolidate)
from infinity.checkpoint._layout import param_ranges
from infinity.checkpoint._load import load_checkpoint
from infinity.checkpoint._reader import (CheckpointError, CheckpointReader, check_save_name,
                                         read_client_state, resolve_checkpoint, tensor_name)
from infinity.checkpoint._save import save_checkpoint
from infinity.checkpoint._target import CheckpointTarget, checkpoint_target
from infinity.checkpoint._weights import WeightsError, load_weights, write_param_values

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "OUT_DTYPES", "CheckpointError", "CheckpointReader",
           "CheckpointTarget", "ConsolidateResult", "WeightsError", "consolidate",
           "check_save_name", "checkpoint_target", "load_checkpoint", "load_weights", "param_ranges",
           "read_client_state", "resolve_checkpoint", "save_checkpoint", "tensor_name",
           "write_param_values"]
