"""The memory ledger and the pricing behind ``infinity plan``: pure arithmetic, no torch.

The estimator (``infinity estimate``), the planner (``infinity plan``) and the engine's own
accounting (``engine.stats()``, the offload budgets) share these rules, so they agree:

- :mod:`._estimate`: bytes per parameter per ZeRO stage and tier (:class:`StateTerms`,
  :class:`Ledger`, :func:`estimate_model_states`, :func:`estimate_from_config`), the ZeRO paper's
  closed form (:func:`paper_bytes_per_device`), and where gradients live ([Note: gradient
  placement], :func:`host_grad_dtype_of`).
- :mod:`._flat_layout`: where parameters sit in a unit's flat buffer, padding included
  (:func:`flat_layout`; [Note: 16-byte aligned slots]).
- :mod:`._model_shape`: a transformer's shape (:class:`ModelShape`): parameters, units.
- :mod:`._activations`: activation bytes per micro-batch (:func:`activation_bytes`).
- :mod:`._quantized`: bytes of a block-quantized tensor on the wire (:func:`quantized_bytes`;
  [Note: quantized wire format]), for ZeRO++'s quantized collectives.
- :mod:`._pricing`: every candidate configuration priced by bytes and a time model
  (:func:`make_plan`; [Note: time model]).
- :mod:`._comm_time`: what a collective costs on nodes x GPUs with two link kinds
  (:class:`Cluster`, ring and hierarchical all-to-all costs; [Note: collective cost over nodes]).
- :mod:`._mesh_plan`: the planner past one node: flat / HSDP / hpZ, qwZ / qgZ and tensor
  parallelism priced per step (:func:`make_mesh_plan`; [Note: mesh time model]).

Module DAG inside the package: ``_estimate``, ``_model_shape`` <- ``_activations`` <- ``_pricing``
<- ``_mesh_plan`` -> ``_comm_time``.
"""

from infinity._tier import Tier
from infinity.ledger._activations import (ACTIVATION_CHUNK_BYTES, ACTIVATION_STAGING_BYTES,
                                         Activations, activation_bytes)
from infinity.ledger._comm_time import (Cluster, Traffic, hierarchical_all_to_all,
                                        pipeline_send, plan_quantized_bytes, ring_all_gather,
                                        ring_all_reduce, ring_reduce_scatter, stage_cluster)
from infinity.ledger._estimate import (DEFAULT_PREFETCH_UNITS, DEFAULT_SUB_GROUP_NUMEL,
                                       ENGINE_GRAD_DTYPE, GB, OPTIMIZER_STAGING_SUBGROUPS,
                                       OPTIMIZERS, REDUCE_INFLIGHT_UNITS, TERMS, Ledger,
                                       StateTerms, ceil_bytes,
                                       estimate_from_config, estimate_model_states, grad_staging_dtype,
                                       host_grad_dtype,
                                       host_grad_dtype_of, paper_bytes_per_device,
                                       stages_in_accumulator_dtype)
from infinity.ledger._flat_layout import (FLAT_ALIGN_BYTES, FlatLayout, flat_layout,
                                          flat_padding_numel)
from infinity.ledger._mesh_plan import (DEFAULT_MFU, DEFAULT_QUANTIZATION_BLOCK_NUMEL,
                                        MIN_GAIN_FRACTION, MeshCandidate, MeshLayout, MeshPlan,
                                        MeshRequest, PIPELINE_SCHEDULE, make_mesh_plan,
                                        mesh_config_dict, mesh_layouts, price_mesh)
from infinity.ledger._model_shape import ModelShape
from infinity.ledger._quantized import (QUANTIZED_BITS, SCALE_BYTES, num_blocks, payload_bytes,
                                        qgz_buffer_bytes, quantized_bytes, qwz_buffer_bytes)
from infinity.ledger._pricing import (BUCKET_BYTES, COLLECTIVE_LATENCY_S, DEVICE_RESERVE_BYTES,
                                      EFFICIENCY_KNEE_TOKENS, EXPOSED_FRACTION, HOST_RESERVE_BYTES,
                                      MICRO_BATCHES, Candidate, Hardware, Plan, PlanRequest,
                                      candidates, make_plan, price)

__all__ = ["BUCKET_BYTES", "COLLECTIVE_LATENCY_S", "Cluster", "DEFAULT_MFU", "DEFAULT_PREFETCH_UNITS", "REDUCE_INFLIGHT_UNITS",
           "DEFAULT_QUANTIZATION_BLOCK_NUMEL", "MIN_GAIN_FRACTION", "MeshCandidate", "MeshLayout",
           "MeshPlan", "MeshRequest", "PIPELINE_SCHEDULE", "Traffic", "hierarchical_all_to_all",
           "make_mesh_plan",
           "mesh_config_dict", "mesh_layouts", "pipeline_send", "plan_quantized_bytes",
           "price_mesh", "ring_all_gather", "ring_all_reduce", "ring_reduce_scatter",
           "stage_cluster",
           "DEFAULT_SUB_GROUP_NUMEL", "DEVICE_RESERVE_BYTES", "EFFICIENCY_KNEE_TOKENS",
           "ENGINE_GRAD_DTYPE", "EXPOSED_FRACTION", "FLAT_ALIGN_BYTES", "FlatLayout", "GB",
           "HOST_RESERVE_BYTES", "MICRO_BATCHES",
           "OPTIMIZERS", "OPTIMIZER_STAGING_SUBGROUPS", "TERMS", "Activations", "Candidate",
           "Hardware", "Ledger", "ModelShape", "Plan", "PlanRequest", "StateTerms", "Tier",
           "activation_bytes", "ACTIVATION_CHUNK_BYTES", "ACTIVATION_STAGING_BYTES", "candidates",
           "ceil_bytes", "estimate_from_config",
           "estimate_model_states", "flat_layout", "flat_padding_numel", "grad_staging_dtype",
           "host_grad_dtype",
           "host_grad_dtype_of", "make_plan", "stages_in_accumulator_dtype",
           "paper_bytes_per_device", "price",
           # ZeRO++ quantized collectives (the quantization part of issue #17)
           "QUANTIZED_BITS", "SCALE_BYTES", "num_blocks", "payload_bytes", "qgz_buffer_bytes",
           "quantized_bytes", "qwz_buffer_bytes"]
