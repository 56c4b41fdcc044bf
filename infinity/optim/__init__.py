"""The optimizer over flat fp32 shards: one entry per unit flat group, this rank's partition.

Interface (every implementation)::

    opt.add(key, master, param_out)        # master: fp32 flat shard (updated in place)
                                           # param_out: the low-precision shard to write, or None
                                           #            when the master *is* the parameter (fp32)
    opt.step(grads, grad_scale=, runs=)    # grads: {key: fp32 flat gradient shard}
                                           #   (offloaded: or a StoredGrad, slices in the store)
                                           # runs: {key: AdamRun slices to update} (None: all)
    opt.state_bytes()                      # bytes of Adam moments held
    opt.master_values(key) / opt.state_of(key)   # fp32 values (a copy where offloaded)
    opt.load_state(key, master=, exp_avg=, exp_avg_sq=)   # overwrite (checkpoint loading)
    with opt.open_master(key) as windows:  # the fp32 master for writing, window by window
    opt.step_count, opt.lr

- :class:`InMemoryShardOptimizer` (:mod:`._in_memory`): masters and moments where they were given
  (the compute device).
- :class:`OffloadedShardOptimizer` (:mod:`._offloaded`): masters and moments in the tiered store
  (HOST or NVME home), stepped by sub-group (:mod:`._sub_group`, the records and their state
  machine) in a pipeline whose reads and writes overlap the update, and, deferred, the next forward;
  its keys in :mod:`._key_table`, its read-ahead window in :mod:`._read_window`, the parameter
  shard it writes in :mod:`._param_out`, a key's state outside the step in :mod:`._key_state`.
- The math: :func:`~infinity.optim.cpu_adam.adam_step_flat` (one fused streaming pass, compiled
  from ``csrc/cpu_adam.cpp``) on CPU tensors, :func:`adam_step_flat_reference` (the readable
  ``torch.optim.AdamW`` order) elsewhere; :class:`~infinity.optim.cpu_adam.CPUAdam` is a drop-in
  ``torch.optim.Optimizer`` over the same kernel.

- :mod:`._runs`: the slices of a partition one kernel call updates, each with its step number and
  hyperparameters ([Note: runs of a flat partition]: parameter groups, parameters without a
  gradient).
- :class:`EngineOptimizer` (:mod:`._engine_optimizer`): ``engine.optimizer``, the engine's Adam
  seen from outside as a ``torch.optim.Optimizer`` (parameter groups, per-parameter step counts,
  state dicts) for LR schedulers and trainers; :func:`resolve_param_groups` builds its groups from
  ``initialize(..., model_parameters=...)``.

Knows no hooks and no units: the parameter manager hands it flat tensors and partition handles.
"""

from infinity.optim._engine_optimizer import EngineOptimizer
from infinity.optim._in_memory import InMemoryShardOptimizer
from infinity.optim._offloaded import OffloadedShardOptimizer
from infinity.optim._param_groups import (HYPERPARAMETERS, check_hyperparameters, json_safe_group,
                                          rebind_param_groups, resolve_param_groups)
from infinity.optim._partition import StoredGrad, open_param_out
from infinity.optim._reference import adam_kernel_for, adam_step_flat_reference
from infinity.optim._runs import AdamRun, Hyperparameters, merge_runs

__all__ = ["HYPERPARAMETERS", "AdamRun", "EngineOptimizer", "Hyperparameters",
           "InMemoryShardOptimizer", "OffloadedShardOptimizer", "StoredGrad", "adam_kernel_for",
           "adam_step_flat_reference", "check_hyperparameters", "json_safe_group", "merge_runs",
           "open_param_out", "rebind_param_groups", "resolve_param_groups"]
