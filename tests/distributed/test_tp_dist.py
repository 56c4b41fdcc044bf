"""Tensor parallelism composed with ZeRO on 4 gloo processes, a 2 (shard) x 2 (tensor) mesh: a
Llama-style model parallelized with ``parallelize_module`` (q/k/v and gate/up colwise, o and down
rowwise; norms, embedding and head plain) trains under the engine and matches the unparallelized
model trained by plain PyTorch on the same global batch: losses, gradient norms (clipping on) and
the final full state dict ([Note: tensor-parallel parameters] in
infinity/zero/_tensor_parallel.py); a checkpoint saved at 2 x 2 resumes at 2 x 2 and at 1 x 2
([Note: checkpoints under tensor parallelism]).

Ranks: tensor groups {0, 1} and {2, 3} (contiguous), data-parallel groups {0, 2} and {1, 3}. The
two tensor ranks of a data-parallel rank see the same micro-batch; the two data-parallel ranks
take the two halves of the global batch.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._support.engine import (BETAS, DTYPES, EPS, LR, WD, assert_close_run, engine_config,
                                   offload_config, reference_train)
from tests._support.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

VOCAB, DIM, HEADS, HIDDEN, LAYERS = 32, 16, 4, 32, 2
STEPS, BATCH, SEQ = 10, 8, 8
CONFIGS = [  # (name, stage, dtype, clip, gradient accumulation steps, data-parallel group passed)
    ("s3-clip", 3, "fp32", 0.05, 1, False),
    ("s3-clip-gas2-group", 3, "fp32", 0.05, 2, True),
    ("s3-bf16-clip", 3, "bf16", 0.05, 1, False),
    # torchtitan's sequence-parallel plan, with activation checkpointing of the blocks.
    ("s3-sequence-parallel-checkpointing-clip", 3, "fp32", 0.05, 1, False),
    ("s3-offload-nvme-clip", 3, "fp32", 0.05, 1, False),  # parameters and optimizer on NVMe
]
if os.environ.get("INFINITY_SLOW") == "1":  # the other stages (each ~5 s of the 4 ranks' time)
    CONFIGS += [(f"s{s}-clip", s, "fp32", 0.05, 1, False) for s in (0, 1, 2)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        # Biases on q (colwise: sharded like its rows) and o (rowwise: a Replicate DTensor, whose
        # gradient the tensor ranks share and the norm counts once).
        self.q, self.o = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.k, self.v = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds HEADS / tensor size of them.
        q, k, v = (m(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(DIM), Attention()
        self.mlp_norm, self.mlp = RMSNorm(DIM), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def tiny_llama() -> TinyLlama:
    torch.manual_seed(0)
    model = TinyLlama()
    with torch.no_grad():  # norms away from 1, so that their gradients and updates matter
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def parallelize(model: TinyLlama, tensor_mesh, *, sequence_parallel: bool = False) -> None:
    """The blocks' linears colwise / rowwise. ``sequence_parallel``: torchtitan's plan, the
    residual stream sharded over the sequence between the blocks' parallel regions, embedding
    and head parallel too; the norms' weights are then Replicate DTensors whose gradients come
    Partial (summed over the tensor ranks by the engine)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    out = Shard(1) if sequence_parallel else Replicate()
    for block in model.blocks:
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(output_layouts=out),
                "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
                "mlp.down": RowwiseParallel(output_layouts=out)}
        if sequence_parallel:
            gather = PrepareModuleInput(input_layouts=(Shard(1),),
                                        desired_input_layouts=(Replicate(),))
            plan.update({"attn_norm": SequenceParallel(), "attn": gather,
                         "mlp_norm": SequenceParallel(), "mlp": gather})
        parallelize_module(block, tensor_mesh, plan)
    if sequence_parallel:
        parallelize_module(model, tensor_mesh, {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(STEPS)]


def reference(clip: float) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch on the whole global batch: losses, gradient norms before clipping, state."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses, norms = [], []
    for idx, targets in global_batches():
        loss = model(idx, targets)
        loss.backward()
        losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(engine, batches, *, dp_rank: int, dp_size: int, dp_group, gas: int = 1
          ) -> tuple[list[float], list[float]]:
    """Train on ``batches`` (global), this data-parallel rank taking its slice: per-step global
    losses and the engine's gradient norms."""
    import torch.distributed as dist

    losses, norms = [], []
    for idx, targets in batches:
        total = torch.zeros(())
        for micro in zip(idx.chunk(dp_size)[dp_rank].chunk(gas),
                         targets.chunk(dp_size)[dp_rank].chunk(gas)):
            loss = engine(*micro)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / dp_size / gas
        dist.all_reduce(total, group=dp_group)
        losses.append(float(total))
        norms.append(engine.last_grad_norm)
    return losses, norms


def worker_tp(rank: int, world_size: int, out_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import infinity

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tensor"))
    dp = dict(dp_rank=mesh.get_local_rank("shard"), dp_size=2, dp_group=mesh.get_group("shard"))
    out = {}
    for name, stage, dtype, clip, gas, pass_group in CONFIGS:
        model = tiny_llama()
        parallelize(model, mesh["tensor"], sequence_parallel="sequence-parallel" in name)
        q = model.blocks[0].attn.q.weight
        if "offload" in name:
            config = offload_config(os.path.join(out_dir, "swap", name), stage=stage,
                                    dtype=dtype, clip=clip, gas=gas, opt="nvme", param="nvme")
        else:
            extra = ({"activation_checkpointing": {"units": "all"}} if "checkpointing" in name
                     else {})
            config = engine_config(stage=stage, dtype=dtype, clip=clip, gas=gas, **extra)
        engine = infinity.initialize(model, config,
                                     data_parallel_group=dp["dp_group"] if pass_group else None)
        # [Note: tensor-parallel parameters]: still the same DTensor, its local tensor a view,
        # both in the compute dtype.
        assert model.blocks[0].attn.q.weight is q and isinstance(q, DTensor)
        assert q.to_local().shape == (DIM // 2, DIM)
        assert q.dtype == q.to_local().dtype == DTYPES[dtype]
        losses, norms = train(engine, global_batches(), gas=gas, **dp)
        stats = engine.stats()
        out[name] = {"losses": losses, "norms": norms, "state": engine.full_state_dict(),
                     "keys": [g.key for u in engine.manager.units for g in u.groups],
                     "world_size": stats["world_size"],
                     "bytes_sent": stats["collective_bytes_sent"]}
        engine.close()
    out["resumed"] = checkpoint_round_trip(mesh, dp, out_dir)
    out["errors"] = rejected_setups(mesh)
    return out


def checkpoint_round_trip(mesh, dp: dict, out_dir: str) -> dict:
    """Stage 3 at 2 x 2: train half the steps, save; a fresh 2 x 2 engine and one sharded over 1
    data-parallel rank load it and train the other half ([Note: checkpoints under tensor
    parallelism]). Every rank passes the path of tensor rank 0's folder."""
    import torch.distributed as dist

    import infinity

    half, root = STEPS // 2, os.path.join(out_dir, "ckpt")
    config = engine_config(stage=3, clip=0.05)
    model = tiny_llama()
    parallelize(model, mesh["tensor"])
    engine = infinity.initialize(model, config)
    train(engine, global_batches()[:half], **dp)
    saved = engine.save_checkpoint(root)
    out = {"saved": saved}
    # Data-parallel size 1: each rank alone in its group (two replicas train the same steps).
    alone, _ = dist.new_subgroups(group_size=1)
    for case, group, dp_now in (("2x2", None, dp),
                                ("1x2", alone, dict(dp_rank=0, dp_size=1, dp_group=alone))):
        model = tiny_llama()
        parallelize(model, mesh["tensor"])
        engine = infinity.initialize(model, config, data_parallel_group=group)
        engine.load_checkpoint(os.path.join(root, "tensor-0-of-2"))
        losses, norms = train(engine, global_batches()[half:], **dp_now)
        out[case] = {"losses": losses, "norms": norms, "state": engine.full_state_dict(),
                     "world_size": engine.stats()["world_size"]}
    return out


def rejected_setups(mesh) -> dict[str, str]:
    """The messages of set-ups the engine refuses (checked by the test)."""
    from torch.distributed.device_mesh import init_device_mesh

    import infinity

    errors = {}
    cases = {
        # The tensor mesh spans every rank: nothing left to shard over.
        "whole-world": lambda: (init_device_mesh("cpu", (4,), mesh_dim_names=("tensor",)), {}),
        # A "data-parallel" group that is the tensor group itself.
        "wrong-group": lambda: (mesh["tensor"], {"data_parallel_group":
                                                 mesh.get_group("tensor")}),
    }
    for case, make in cases.items():
        tensor_mesh, kwargs = make()
        model = tiny_llama()
        parallelize(model, tensor_mesh)
        try:
            infinity.initialize(model, engine_config(stage=3), **kwargs)
        except ValueError as e:
            errors[case] = str(e)
    return errors


def test_tensor_parallel_with_zero_matches_plain_pytorch():
    results = launch(__file__, "worker_tp", world_size=4, timeout_s=240)
    ref_losses, ref_norms, ref_state = reference(0.05)
    half = STEPS // 2
    for rank, res in enumerate(results):
        resumed = res["resumed"]
        assert f"tensor-{rank % 2}-of-2" in resumed["saved"], resumed["saved"]
        for case, dp_size in (("2x2", 2), ("1x2", 1)):
            got = resumed[case]
            assert got["world_size"] == dp_size
            assert got["losses"] == pytest.approx(ref_losses[half:], abs=1e-5), (case, rank)
            assert got["norms"] == pytest.approx(ref_norms[half:], rel=1e-5), (case, rank)
            for key, want in ref_state.items():
                torch.testing.assert_close(got["state"][key], want, atol=1e-5, rtol=0.0,
                                           msg=lambda m, key=key: f"{case} rank {rank} {key}: {m}")
    for rank, res in enumerate(results):
        assert "no data-parallel dimension" in res["errors"].get("whole-world", ""), rank
        assert "share ranks" in res["errors"].get("wrong-group", ""), rank
    for name, stage, dtype, clip, _gas, _pass_group in CONFIGS:
        if dtype != "fp32":
            # The textbook mixed-precision recipe, each data-parallel rank's half of the batch
            # as its own backward (as the ranks do), with its tolerance (TOL).
            data = [[batch] for batch in global_batches()]
            ref_losses, ref_state = reference_train(tiny_llama(), data, dtype=dtype, clip=clip,
                                                    splits=2)
            for rank, res in enumerate(results):
                assert_close_run(res[name]["losses"], res[name]["state"], ref_losses, ref_state,
                                 dtype)
            continue
        ref_losses, ref_norms, ref_state = reference(clip)
        assert max(ref_norms) > clip  # clipping is active, so a wrong norm changes the update
        for rank, res in enumerate(results):
            got = res[name]
            assert got["world_size"] == 2, (name, rank)  # sharded over the data-parallel group
            # Sharded and replicated parameters in separate groups of each block's unit.
            assert any(k.endswith(".tp") for k in got["keys"]), got["keys"]
            # Stage 3 gathers the blocks for forward and backward, within the data-parallel group.
            assert (got["bytes_sent"].get("backward-gather", 0) > 0) == (stage == 3), name
            assert got["losses"] == pytest.approx(ref_losses, abs=1e-5), (name, rank)
            assert got["norms"] == pytest.approx(ref_norms, rel=1e-5), (name, rank)
            assert list(got["state"]) == list(ref_state), (name, rank)
            for key, want in ref_state.items():
                torch.testing.assert_close(got["state"][key], want, atol=1e-5, rtol=0.0,
                                           msg=lambda m, key=key: f"{name} rank {rank} {key}: {m}")
