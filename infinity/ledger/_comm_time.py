"""What one collective costs on a cluster of nodes: bytes per link kind and seconds (pure arithmetic).

The planner past one node (:mod:`._mesh_plan`) prices every candidate mesh with these functions;
``infinity bench comm`` prints them next to the bytes the engine counts. The rules are written
once, here:

[Note: collective cost over nodes] A cluster is ``nodes`` x ``gpus_per_node`` ranks, rank ``r`` on
node ``r // gpus_per_node``. Two bandwidths, both *bus bandwidths* (what ``nccl-tests`` reports,
one direction):

* ``intra_node_bytes_per_s`` (B_in): per GPU, over NVLink (or whatever joins a node's GPUs);
* ``inter_node_bytes_per_s`` (B_out): per *node*, its NICs together (InfiniBand / RoCE). The
  node's ranks share it: G ranks each sending X bytes across nodes take G X / B_out.

A process group of k ranks with c of them on each node it touches spans n = k / c nodes, and
G / c such groups (the other ranks' copies of it) run at the same time on every node.

* Ring all-gather / reduce-scatter of a payload of M bytes (the gathered size, or the size of
  the reduce-scatter's input): every rank sends (k-1)/k x M. In a ring ordered by node, one of
  each node's c out-edges crosses to the next node when n > 1, so averaged over the node's ranks
  a rank sends ``inter = (k-1)/k x M / c`` across nodes and ``intra = (k-1)/k x M x (c-1)/c``
  inside it (n = 1: everything inside). Every edge carries the whole stream, so::

      time = max((k-1)/k x M / B_in        if c > 1,
                 G x inter / B_out          if n > 1)

  (the ring is pipelined: the slower link kind bounds it). For the flat group (c = G, k = N G)
  this is (k-1)/k x M / B_out: a group spanning nodes is bound by the inter-node link.
* Ring all-reduce: a reduce-scatter and an all-gather of the same M (twice the above).
* ZeRO++'s hierarchical all-to-all (qgZ), payload M quantized as Q(M) bytes: an all-to-all inside
  the node (each rank sends (c-1)/c x Q(M) over NVLink, receives its 1/c slice from the others,
  dequantizes and sums in fp32), then an all-to-all across nodes among the ranks with the same
  local index (each sends (n-1)/n x Q(M / c), summed again in fp32). ZeRO++ overlaps the two
  phases across chunks, so the time is their max, as for the ring::

      time = max((c-1)/c x Q(M) / B_in,  G x (n-1)/n x Q(M/c) / B_out)

  A node then sends (n-1)/n x Q(M) across nodes, against (k-1)/k x M for a reduce-scatter in
  full precision: ~4x fewer bytes with int8 + fp32 scales against fp32 (8x with int4).
* Quantized payloads (qwZ, qgZ): ``bits``/8 bytes per element plus one ``scale_bytes`` scale
  per block of ``block_numel`` elements (:func:`plan_quantized_bytes`).
* Pipeline send/recv (:func:`pipeline_send`): K stages of W / K consecutive ranks; every rank
  sends M bytes to the rank of the same index in the next stage (point-to-point, one
  direction). A stage of G ranks or more fills whole nodes, so every stage boundary crosses
  nodes: a node's G ranks send at once, G M / B_out. A smaller stage sits inside a node, and
  the boundaries between two nodes' stages (there are N - 1 when N > 1) cross with the W / K
  ranks of one stage sending: (W / K) M / B_out; the others take M / B_in. The pipeline runs at
  the pace of its slowest boundary, so the time is the max of those present, and the bytes are
  those of a rank on that boundary (M across nodes when N > 1, else M inside).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infinity.ledger._quantized import quantized_bytes

__all__ = ["Cluster", "Traffic", "hierarchical_all_to_all", "pipeline_send", "plan_quantized_bytes",
           "ring_all_gather", "ring_all_reduce", "ring_reduce_scatter", "stage_cluster"]


def plan_quantized_bytes(numel: float, *, block_numel: int, bits: int, scale_bytes: int = 4) -> float:
    """Bytes of ``numel`` elements quantized to ``bits`` (8 or 4) with one ``scale_bytes`` scale per
    block of ``block_numel`` ([Note: collective cost over nodes], last point): the engine's own
    wire format (:func:`~infinity.ledger._quantized.quantized_bytes`) at a planner's fractional
    element count (a slice per node), rounded up to whole elements."""
    if bits not in (4, 8):
        raise ValueError(f"bits: expected 8 or 4, got {bits!r}")
    if isinstance(block_numel, bool) or not isinstance(block_numel, int) or block_numel < 1:
        raise ValueError(f"block_numel: expected an integer >= 1, got {block_numel!r}")
    if numel <= 0:
        return 0.0
    return float(quantized_bytes(math.ceil(numel), block_numel, bits, scale_bytes))


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Nodes of identical GPUs and the two link kinds (see [Note: collective cost over nodes])."""

    nodes: int
    gpus_per_node: int
    intra_node_bytes_per_s: float
    """Per GPU: NVLink bus bandwidth, one direction."""
    inter_node_bytes_per_s: float
    """Per node: all its NICs together, one direction."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster.{name}: expected an integer >= 1, got {value!r}")
        for name in ("intra_node_bytes_per_s", "inter_node_bytes_per_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"Cluster.{name}: expected a bandwidth > 0 bytes/s, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """What collectives cost one rank: bytes it sends per link kind (averaged over a node's
    ranks), seconds, and how many collectives were issued (each pays a fixed latency)."""

    intra_bytes: float = 0.0
    inter_bytes: float = 0.0
    time_s: float = 0.0
    count: int = 0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(intra_bytes=self.intra_bytes + other.intra_bytes,
                       inter_bytes=self.inter_bytes + other.inter_bytes,
                       time_s=self.time_s + other.time_s, count=self.count + other.count)

    def times(self, k: float) -> "Traffic":
        """``k`` repetitions (``count`` rounds up: a collective is issued whole)."""
        return Traffic(intra_bytes=k * self.intra_bytes, inter_bytes=k * self.inter_bytes,
                       time_s=k * self.time_s, count=int(math.ceil(k * self.count)))

    @property
    def total_bytes(self) -> float:
        return self.intra_bytes + self.inter_bytes


def _layout(cluster: Cluster, group_size: int, ranks_per_node: int) -> tuple[int, int, int]:
    k, c = group_size, ranks_per_node
    if k < 1 or c < 1 or k % c or c > cluster.gpus_per_node or cluster.gpus_per_node % c:
        raise ValueError(f"a group of {k} ranks with {c} per node does not tile nodes of "
                         f"{cluster.gpus_per_node} GPUs")
    return k, c, k // c


def ring_all_gather(cluster: Cluster, *, group_size: int, ranks_per_node: int,
                    payload_bytes: float) -> Traffic:
    """One ring all-gather of ``payload_bytes`` (the gathered size) over a group of
    ``group_size`` ranks, ``ranks_per_node`` of them per node ([Note: collective cost over nodes])."""
    k, c, n = _layout(cluster, group_size, ranks_per_node)
    if k == 1 or payload_bytes <= 0:
        return Traffic()
    sent = (k - 1) / k * payload_bytes
    if n == 1:
        return Traffic(intra_bytes=sent, time_s=sent / cluster.intra_node_bytes_per_s, count=1)
    inter = sent / c
    time_s = max(sent / cluster.intra_node_bytes_per_s if c > 1 else 0.0,
                 cluster.gpus_per_node * inter / cluster.inter_node_bytes_per_s)
    return Traffic(intra_bytes=sent - inter, inter_bytes=inter, time_s=time_s, count=1)


def ring_reduce_scatter(cluster: Cluster, *, group_size: int, ranks_per_node: int,
                        payload_bytes: float) -> Traffic:
    """A ring reduce-scatter moves what an all-gather of the same payload moves."""
    return ring_all_gather(cluster, group_size=group_size, ranks_per_node=ranks_per_node,
                           payload_bytes=payload_bytes)


def ring_all_reduce(cluster: Cluster, *, group_size: int, ranks_per_node: int,
                    payload_bytes: float) -> Traffic:
    """Reduce-scatter then all-gather: twice the bytes, one collective issued."""
    one = ring_all_gather(cluster, group_size=group_size, ranks_per_node=ranks_per_node,
                          payload_bytes=payload_bytes)
    return Traffic(intra_bytes=2 * one.intra_bytes, inter_bytes=2 * one.inter_bytes,
                   time_s=2 * one.time_s, count=one.count)


def hierarchical_all_to_all(cluster: Cluster, *, group_size: int, ranks_per_node: int,
                            numel: float, block_numel: int, bits: int) -> Traffic:
    """ZeRO++'s qgZ reduce-scatter of ``numel`` gradient elements, quantized to ``bits`` with
    per-block fp32 scales: an all-to-all inside the node, then one across nodes
    ([Note: collective cost over nodes]); two collectives issued when it spans nodes."""
    k, c, n = _layout(cluster, group_size, ranks_per_node)
    if k == 1 or numel <= 0:
        return Traffic()
    intra = (c - 1) / c * plan_quantized_bytes(numel, block_numel=block_numel, bits=bits)
    inter = (n - 1) / n * plan_quantized_bytes(numel / c, block_numel=block_numel, bits=bits)
    time_s = max(intra / cluster.intra_node_bytes_per_s,
                 cluster.gpus_per_node * inter / cluster.inter_node_bytes_per_s)
    return Traffic(intra_bytes=intra, inter_bytes=inter, time_s=time_s,
                   count=(1 if c > 1 else 0) + (1 if n > 1 else 0))


def stage_cluster(cluster: Cluster, stages: int) -> Cluster:
    """The nodes one of ``stages`` pipeline stages occupies (W / K consecutive ranks): whole
    nodes when a stage has G ranks or more, else part of one node (a one-node cluster of W / K
    GPUs: its collectives never leave the node). ValueError when the stages do not tile."""
    w, g = cluster.world_size, cluster.gpus_per_node
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1 or w % stages:
        raise ValueError(f"{stages!r} pipeline stages do not tile {cluster.nodes} x {g} GPUs: "
                         f"choose a divisor of {w}")
    ranks = w // stages
    if stages == 1:
        return cluster
    if ranks % g and g % ranks:
        raise ValueError(f"pipeline stages of {ranks} ranks do not tile nodes of {g} GPUs")
    return Cluster(nodes=max(1, ranks // g), gpus_per_node=min(ranks, g),
                   intra_node_bytes_per_s=cluster.intra_node_bytes_per_s,
                   inter_node_bytes_per_s=cluster.inter_node_bytes_per_s)


def pipeline_send(cluster: Cluster, *, stages: int, payload_bytes: float) -> Traffic:
    """One point-to-point transfer of ``payload_bytes`` from every rank of a pipeline stage to
    the next stage's rank of the same index, at the pace of the slowest stage boundary
    ([Note: collective cost over nodes], pipeline send/recv)."""
    ranks = stage_cluster(cluster, stages).world_size
    if stages == 1 or payload_bytes <= 0:
        return Traffic()
    inside = payload_bytes / cluster.intra_node_bytes_per_s
    if cluster.nodes == 1:
        return Traffic(intra_bytes=payload_bytes, time_s=inside, count=1)
    g = cluster.gpus_per_node
    across = min(ranks, g) * payload_bytes / cluster.inter_node_bytes_per_s
    return Traffic(inter_bytes=payload_bytes, time_s=max(inside if ranks < g else 0.0, across),
                   count=1)
