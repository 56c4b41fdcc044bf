"""Activation bytes of one rank for one micro-batch, with and without activation checkpointing
(Korthikanti et al. 2022, arXiv 2205.05198), and where they live ([Note: activation placement])."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infinity._tier import Tier
from infinity.ledger._estimate import ceil_bytes
from infinity.ledger._model_shape import ModelShape


ACTIVATION_CHUNK_BYTES = 4 * 1024 * 1024
"""Largest shard of one saved activation in the store ([Note: chunks] in
infinity/zero/_stored_activations.py)."""
ACTIVATION_STAGING_BYTES = 4 * ACTIVATION_CHUNK_BYTES
"""Host arena room activations bound for NVMe want: chunks written behind and read ahead."""

OFFLOAD_TIERS = {"none": Tier.DEVICE, "host": Tier.HOST, "nvme": Tier.NVME}
"""``activation_checkpointing.offload`` -> the tier the kept layer inputs live in."""


@dataclass(frozen=True, kw_only=True)
class Activations:
    """Activation bytes of one rank for one micro-batch (Korthikanti et al. 2022, arXiv 2205.05198)."""

    per_layer_bytes: int
    """sbh(34 + 5as/h) in 16-bit, the 5as/h with eager attention only ([Note: fused attention keeps
    no scores]): everything one layer keeps for backward without recomputation."""
    stored_bytes: int
    """Kept across the whole forward: all layers, or only each layer's input (2sbh) with checkpointing."""
    recompute_bytes: int
    """One layer's working set rebuilt during backward (checkpointing only)."""
    head_bytes: int
    """Final norm and output-projection inputs (4sbh) and the fp32 logits for the loss (4sbv)."""
    checkpointing: bool
    offload: str = "none"
    """Where the kept layer inputs (``stored_bytes``) sit between forward and recompute: 'none'
    (the device), 'host' or 'nvme' (``activation_checkpointing.offload``); see [Note: activation
    placement]."""

    @property
    def offload_to_host(self) -> bool:
        return self.offload == "host"

    @property
    def total_bytes(self) -> int:
        return self.stored_bytes + self.recompute_bytes + self.head_bytes

    @property
    def host_bytes(self) -> int:
        """Bytes homed in host memory: the layer inputs offloaded to host, else nothing."""
        return self.stored_bytes if self.offload == "host" else 0

    @property
    def nvme_bytes(self) -> int:
        """Bytes homed on NVMe: the layer inputs offloaded there, else nothing."""
        return self.stored_bytes if self.offload == "nvme" else 0

    @property
    def device_bytes(self) -> int:
        """Bytes on the device: everything but what is offloaded."""
        return self.total_bytes - self.host_bytes - self.nvme_bytes

    @property
    def moved_bytes(self) -> int:
        """Bytes an offload moves per micro-batch each way (device -> host, and to NVMe and back
        for 'nvme'): the kept inputs once out, once back; 0 on the device."""
        return 0 if self.offload == "none" else self.stored_bytes

    def tier_bytes(self, tier: "Tier | str") -> int:
        return {Tier.DEVICE: self.device_bytes, Tier.HOST: self.host_bytes,
                Tier.NVME: self.nvme_bytes}[Tier(tier)]

    def to_dict(self) -> dict[str, Any]:
        return {"per_layer_bytes": self.per_layer_bytes, "stored_bytes": self.stored_bytes,
                "recompute_bytes": self.recompute_bytes, "head_bytes": self.head_bytes,
                "checkpointing": self.checkpointing, "offload": self.offload,
                "offload_to_host": self.offload_to_host,
                "total_bytes": self.total_bytes, "device_bytes": self.device_bytes,
                "host_bytes": self.host_bytes, "nvme_bytes": self.nvme_bytes}


def attention_scores_term(shape: ModelShape, seq_len: int, tensor: int = 1) -> float:
    """[Note: fused attention keeps no scores]
    Korthikanti et al.'s 5as/h per layer (5as/(ht) over t tensor ranks) is the attention's
    scores (2 bytes), softmax output (2) and dropout mask (1) per head and token pair: what an
    eager attention keeps for backward. SDPA and FlashAttention (torch's default, the engine's
    GPT, Hugging Face's default ``attn_implementation``) recompute the scores in backward from
    q, k, v and keep one fp32 log-sum-exp per head and token (4abs bytes: a fraction of a
    percent of the 34sbh term, 4a/34h), which the ledger leaves out. At long context the term
    decides everything: at 4096 tokens, 8 sequences, width 2048 and 16 heads it is 160 of the
    layer's 194 sbh, 11 of its 13 GB, and the planner refused long-context candidates that fit."""
    if not shape.eager_attention:
        return 0.0
    return 5 * shape.num_heads * seq_len / (shape.hidden_size * tensor)


def activation_bytes(shape: ModelShape, *, micro_batch: int, seq_len: int | None = None,
                     checkpointing: bool = False, offload_to_host: bool = False,
                     offload: str = "none", dtype_bytes: int = 2) -> Activations:
    """Activations of ``micro_batch`` sequences (Korthikanti et al., section 4, no tensor parallelism).

    Without recomputation a layer keeps sbh(34 + 5as/h) bytes in 16-bit (s sequence, b micro-batch,
    h hidden, a heads; the 5as/h term is the attention scores, softmax and its dropout mask, kept
    only with ``shape.eager_attention``: [Note: fused attention keeps no scores]). With
    full activation checkpointing only each layer's input, 2sbh, is kept, and one layer's working set
    is rebuilt at a time during backward. ``dtype_bytes`` = 4 scales the formula for fp32 compute.
    ``offload`` (checkpointing only; ``offload_to_host`` is 'host'): 'host' or 'nvme', where the
    kept inputs live ([Note: activation placement]).

    [Note: activation placement] Everything is on the device, except with an offload: the L kept
    layer inputs (2sbh each in 16-bit) are copied out as they are saved and back for their layer's
    recompute (:mod:`infinity.zero._stored_activations`), so the device holds one layer's working
    set (its input included) and the head; the host ('host') or the swap files ('nvme') hold
    L x 2sbh per rank. 'nvme' also passes every input through the host arena on its way out and
    back (a few at a time, inside the host budget); the engine's 'auto' fills the host's spare
    room first. Without a store ('host' and an 'auto' host budget, no state offloaded) the host
    copies go through torch's caching host allocator, which can round each block up (to a power
    of two); the ledger counts the bytes asked for.
    """
    name = "offload_to_host" if offload_to_host else f"offload {offload!r}"
    if offload_to_host:
        offload = "host"
    if offload not in OFFLOAD_TIERS:
        raise ValueError(f"offload: expected 'none', 'host' or 'nvme', got {offload!r}")
    if offload != "none" and not checkpointing:
        raise ValueError(f"{name}: needs checkpointing (only the inputs kept by "
                         "checkpointed layers are offloaded); enable checkpointing or drop the "
                         "offload")
    s = seq_len or shape.seq_len
    b, h, L = micro_batch, shape.hidden_size, shape.num_layers
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        raise ValueError(f"micro_batch: expected an integer >= 1, got {b!r}")
    scale = dtype_bytes / 2
    per_layer = ceil_bytes(s * b * h * (34 + attention_scores_term(shape, s)) * scale)
    head = ceil_bytes(4 * s * b * h * scale + 4 * s * b * shape.vocab_size)
    if checkpointing:
        stored = ceil_bytes(L * 2 * s * b * h * scale)
        return Activations(per_layer_bytes=per_layer, stored_bytes=stored, recompute_bytes=per_layer,
                           head_bytes=head, checkpointing=True, offload=offload)
    return Activations(per_layer_bytes=per_layer, stored_bytes=L * per_layer, recompute_bytes=0,
                       head_bytes=head, checkpointing=False)
