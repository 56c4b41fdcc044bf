"""Shared by the planner's tests (``tests/unit/test_mesh_plan*.py``): the model shapes, the
hand-worked cluster and the requests they price."""

from __future__ import annotations

from infinity._common import GiB
from infinity.ledger import Cluster, MeshRequest, ModelShape

LLAMA_7B = ModelShape(kind="llama", num_layers=32, hidden_size=4096, num_heads=32, vocab_size=32000,
                      intermediate_size=11008, seq_len=2048, tie_word_embeddings=False)
LLAMA_70B = ModelShape(kind="llama", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
                       vocab_size=32000, intermediate_size=28672, seq_len=2048,
                       tie_word_embeddings=False)
TINY = ModelShape(kind="gpt2", num_layers=2, hidden_size=64, num_heads=2, vocab_size=64,
                  seq_len=100)
"""Units and activations only: the bytes of the hand-worked case come from ``numel``."""

# The hand-worked cluster: 2 nodes x 2 GPUs, 100 GB/s per GPU inside a node, 10 GB/s per node
# across nodes.
TWO_BY_TWO = Cluster(nodes=2, gpus_per_node=2, intra_node_bytes_per_s=100e9,
                     inter_node_bytes_per_s=10e9)
P = 1_000_000
BLOCK = 1000


def h100_request(shape: ModelShape, **kw) -> MeshRequest:
    base = dict(numel=shape.num_params(), shape=shape, device_memory_bytes=80 * GiB,
                device_flops=989e12, device_memory_bytes_per_s=3.35e12)
    base.update(kw)
    return MeshRequest(**base)


def tiny_request(**kw) -> MeshRequest:
    base = dict(numel=P, shape=TINY, device_memory_bytes=80 * GiB, device_flops=1e12, mfu=0.5,
                device_memory_bytes_per_s=1e12, quantization_block_numel=BLOCK,
                checkpointing=(False,))
    base.update(kw)
    return MeshRequest(**base)
