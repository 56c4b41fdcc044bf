"""Embedding gradients as rows: what an embedding adds to its weight's gradient crosses ranks as
the rows its tokens touched, at the end of backward.

[Note: embedding rows cross ranks as rows]
An embedding is the first module of the forward, so its gradient is the last of the backward,
and the unit that holds it (the root, with a language model's 50k-256k x hidden table) can only
be reduced after the backward's last kernel: every byte of that reduction sits between the
backward and the optimizer step, where nothing hides it. With a tied LM head it is worse: the
head makes its dense gradient of the same weight at the *start* of the backward, but the two add
into one ``param.grad`` that autograd hands over at the end. On the 135M GPT at 2 ranks (29 % of
the parameters in the tied table) that tail was 0.69 s of link time a step that no schedule can
overlap (#30's schedule bound).

Yet what the embedding adds is rows: only the rows of the tokens in this rank's batch (512 of
50,257 at batch 4 x 128), and an embedding's backward never reads its weight. So with several
data-parallel ranks each plain ``nn.Embedding`` with a trainable managed weight runs through
:class:`_EmbeddingRowsFunction` (its forward is ``F.embedding``): the weight goes in detached,
so autograd's accumulation of the weight waits only for the weight's other users (the tied
head: its gradient is then complete at the head's backward, and the unit reduced at once, a
backward ahead of the rest), and the backward hands this rank's rows (unique token ids, their
summed gradient rows in fp32) to the parameter manager instead of a gradient. A zero-size
tensor that requires grad (the *anchor*) is the Function's only differentiable input: it makes
autograd run the backward, and gets no gradient.

At the end of backward the manager reduces the rows. At stages 2-3 without replicas each row
goes to the rank whose shard holds it (split where it crosses a shard's end): an all-to-all of
the chunks' sizes, then one of the chunks, so a rank sends and receives about its own rows' bytes
(a few MB instead of the table) whatever the number of ranks. Where every rank needs every row
(stages 0-1, or replicas over a mesh) they are all-gathered over the data-parallel group, padded
to the largest rank's (over the shard group, or routed as above at stages 2-3, where the replicas
sum the accumulators once per step: [Note: replicas summed once per step] in
infinity/zero/_grad_reducer.py). At stages 0-1 in a window of several micro-batches they are
summed densely instead, with the rest of the window's gradient, which crosses once ([Note: one
all-reduce per window at stages 0-1] in infinity/zero/_grad_reducer.py). Each rank adds what falls in its partition into its accumulator: exact
fp32 sums. What the largest rank sends rides on the end-of-backward flags all-reduce that runs
anyway; where that is not fewer bytes than reducing the tables densely (huge batches, tiny
vocabularies, all-gathers over many ranks) the ranks, agreeing through the same flags, add the
rows into the staging buffer instead, reduce the units densely, and remove the taps for good.
The reduction order ([Note: every rank reduces every unit in one order]) places a unit by its
gradients that autograd accumulates, so the root with a tied head is reduced first; at stages
2-3 the head's backward itself issues most of that reduction ([Note: the head's gradient
reduced as it is made] in infinity/zero/_head_grad.py).

Not tapped (their gradient goes through autograd as before): subclasses that change
``forward`` (a scaled embedding), ``max_norm`` (it writes the weight), ``scale_grad_by_freq``
and ``sparse`` (torch's own sparse gradient), tensor-parallel (DTensor) weights, frozen weights,
and everything at one rank (nothing crosses ranks there). A weight that is also read outside
its modules (``x @ wte.weight.T`` in a model's forward) still gets that use's gradient through
autograd: it is reduced with its unit, densely, as a late gradient where the unit was complete.
"""

from __future__ import annotations

import types
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from infinity.zero._tensor_parallel import is_dtensor

RowsSink = Callable[[nn.Parameter, torch.Tensor, torch.Tensor], None]
"""(weight, unique token ids (int64, n), their gradient rows (fp32, n x row numel))."""


def _tappable(module: nn.Module, managed: set[int]) -> bool:
    """A plain ``nn.Embedding`` whose trainable weight the manager holds and whose gradient is
    rows only (see the note for what is left out)."""
    weight = getattr(module, "weight", None)
    return (isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward
            and isinstance(weight, nn.Parameter) and weight.requires_grad
            and id(weight) in managed and not is_dtensor(weight)
            and module.max_norm is None and not module.scale_grad_by_freq and not module.sparse)


class _EmbeddingRowsFunction(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward gives its rows to a sink, not to autograd."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, anchor: torch.Tensor,
                module: nn.Embedding, sink: RowsSink) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.module, ctx.sink = module, sink
        return F.embedding(ids, weight, module.padding_idx)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (ids,) = ctx.saved_tensors
        module = ctx.module
        width = grad_out.shape[-1]
        flat_ids = ids.reshape(-1)
        grads = grad_out.reshape(-1, width)
        if module.padding_idx is not None:  # torch leaves that row's gradient at zero
            keep = flat_ids != module.padding_idx
            flat_ids, grads = flat_ids[keep], grads[keep]
        unique, inverse = torch.unique(flat_ids, return_inverse=True)
        rows = torch.zeros(unique.numel(), width, dtype=torch.float32, device=grads.device)
        rows.index_add_(0, inverse, grads.float())
        ctx.sink(module.weight, unique, rows)
        return None, None, None, None, None


MIN_VOCABULARY_ROWS = 4096
"""A unit's embeddings are tapped when one of them has at least this many rows (a vocabulary;
a position table rides with its unit's vocabulary: the unit is complete only when all of its
parameters are). A smaller table is about as many bytes as a batch's rows, and its tail is
short anyway."""


def holders_of(model: nn.Module) -> dict[int, list[nn.Module]]:
    """id(parameter) -> the modules holding it in their own ``_parameters`` (a tied weight has
    several)."""
    holders: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                holders.setdefault(id(p), []).append(m)
    return holders


class ForwardTaps:
    """Modules whose ``forward`` a tap replaces by its own (``_forward(module, *args)``, bound as
    an instance attribute, so removing it restores the class's), and the empty anchor tensors
    that make autograd run their Functions' backward."""

    def __init__(self, modules: list[nn.Module]):
        self.modules = list(modules)
        self._anchors: dict[torch.device, torch.Tensor] = {}

    def install(self) -> None:
        for m in self.modules:
            m.forward = types.MethodType(self._forward, m)  # an instance attribute: removable

    def remove(self, modules: list[nn.Module] | None = None) -> None:
        """Untap ``modules`` (all: None) for good."""
        gone = self.modules if modules is None else modules
        for m in gone:
            if "forward" in m.__dict__:
                del m.forward
        self.modules = [m for m in self.modules if all(m is not g for g in gone)]

    def _anchor(self, device: torch.device) -> torch.Tensor:
        anchor = self._anchors.get(device)
        if anchor is None:
            anchor = self._anchors[device] = torch.zeros(0, device=device, requires_grad=True)
        return anchor

    def _forward(self, module: nn.Module, *args: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class EmbeddingRows(ForwardTaps):
    """The tapped embeddings of one model ([Note: embedding rows cross ranks as rows])."""

    def __init__(self, model: nn.Module, managed: set[int], sink: RowsSink, *,
                 unit_of: Callable[[nn.Parameter], int]):
        """``managed``: id() of the trainable parameters the manager reduces; ``unit_of``: the
        unit index of one of them."""
        candidates = [m for m in model.modules() if _tappable(m, managed)]
        vocabularies = {unit_of(m.weight) for m in candidates
                        if m.num_embeddings >= MIN_VOCABULARY_ROWS}
        super().__init__([m for m in candidates if unit_of(m.weight) in vocabularies])
        tapped = {id(m) for m in self.modules}
        holders = holders_of(model)
        self.tapped_modules: set[int] = tapped
        """id() of the tapped modules: their use of the weight is not accumulated by autograd."""
        self.rows_only: set[int] = {id(m.weight) for m in self.modules
                                    if all(id(h) in tapped for h in holders[id(m.weight)])}
        """id() of the weights held only by tapped embeddings: autograd accumulates nothing into
        them (unless read outside their modules), their gradient is the rows."""
        self._sink = sink

    def _forward(self, module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        if not (torch.is_grad_enabled() and weight.requires_grad):
            return nn.Embedding.forward(module, ids)
        return _EmbeddingRowsFunction.apply(ids, weight.detach(), self._anchor(weight.device),
                                            module, self._sink)


def _offsets_within(counts: torch.Tensor) -> torch.Tensor:
    """For runs of ``counts`` elements laid end to end: each element's place in its run."""
    total = int(counts.sum())
    return torch.arange(total, device=counts.device) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts, output_size=total)


class RowsPayload:
    """Rows of one backward, packed for another rank: a header (rows, values), per row (group
    number, flat start in the group's buffer, length), then the values (fp32)."""

    HEADER = 2

    @staticmethod
    def pack(entries: list[tuple[int, int, torch.Tensor, torch.Tensor]], scale: float,
             device: torch.device, *, shard_numel: list[int], world: int
             ) -> tuple[torch.Tensor, list[int]]:
        """``entries``: (group number, slot offset, unique ids, rows (n x row numel)); values
        multiplied by ``scale`` (1 / data-parallel ranks). One payload per destination rank,
        concatenated: each row goes to the rank whose shard of its group holds it
        (``shard_numel[group number]`` elements each), split in two where it crosses a shard's
        end; ``world`` 1 with the groups' whole sizes is one payload for every rank. Returns the
        bytes (uint8) and each destination's byte count (each a multiple of 8)."""
        metas, values = [], []
        for number, offset, ids, rows in entries:
            width = rows.shape[1]
            if not ids.numel() or not width:
                continue
            shard = shard_numel[number]
            starts = ids.to(device) * width + offset
            first = starts // shard
            parts = (starts + width - 1) // shard - first + 1
            row = torch.repeat_interleave(torch.arange(ids.numel(), device=device), parts)
            dest = first[row] + _offsets_within(parts)
            lo = torch.maximum(starts[row], dest * shard)
            hi = torch.minimum(starts[row] + width, (dest + 1) * shard)
            lens = hi - lo
            meta = torch.stack([torch.full_like(lo, number), lo, lens, dest], 1)
            flat = rows.reshape(-1).to(device=device, dtype=torch.float32) * scale
            base = torch.repeat_interleave(row * width + (lo - starts[row]), lens)
            metas.append(meta)
            values.append((torch.repeat_interleave(dest, lens), flat[base + _offsets_within(lens)]))
        chunks, sizes = [], []
        for d in range(world):
            mine = [m[m[:, 3] == d, :3] for m in metas]
            vals = [v[dd == d] for dd, v in values]
            chunk = RowsPayload._bytes(torch.cat(mine) if mine else
                                       torch.empty(0, 3, dtype=torch.int64, device=device),
                                       torch.cat(vals) if vals else
                                       torch.empty(0, dtype=torch.float32, device=device))
            pad = -chunk.numel() % 8
            if pad:
                chunk = torch.cat([chunk, torch.zeros(pad, dtype=torch.uint8, device=device)])
            chunks.append(chunk)
            sizes.append(chunk.numel())
        return torch.cat(chunks), sizes

    @staticmethod
    def _bytes(meta: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        header = torch.tensor([meta.shape[0], vals.numel()], dtype=torch.int64, device=vals.device)
        return torch.cat([header.view(torch.uint8), meta.contiguous().reshape(-1).view(torch.uint8),
                          vals.contiguous().view(torch.uint8)])

    @staticmethod
    def unpack(payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(group number per element, flat index per element, value per element) of one rank's
        payload (its padding ignored)."""
        head = RowsPayload.HEADER * 8
        n_rows, n_values = payload[:head].view(torch.int64).tolist()
        meta_end = head + n_rows * 24
        meta = payload[head:meta_end].view(torch.int64).view(n_rows, 3)
        values = payload[meta_end:meta_end + n_values * 4].view(torch.float32)
        lens = meta[:, 2]
        index = torch.repeat_interleave(meta[:, 1], lens, output_size=n_values) + \
            _offsets_within(lens)
        number = torch.repeat_interleave(meta[:, 0], lens, output_size=n_values)
        return number, index, values
