"""Pipeline parallelism in the planner past one node ([Note: mesh time model] in
infinity/ledger/_mesh_plan.py, the pipeline point; the send/recv cost in [Note: collective cost
over nodes] in infinity/ledger/_comm_time.py): the send/recv and the step time worked by hand,
the bubble (K-1)/(m+K-1), candidates without a pipeline priced exactly as before it existed,
memory per rank, the choices on slow and fast links, the written config and the CLI."""

from __future__ import annotations

import json
import math

import pytest

from infinity import cli
from infinity.ledger import (COLLECTIVE_LATENCY_S, EXPOSED_FRACTION, MIN_GAIN_FRACTION, Cluster,
                             MeshLayout, make_mesh_plan, mesh_config_dict, mesh_layouts,
                             paper_bytes_per_device, pipeline_send, price_mesh, stage_cluster)
from tests._support.mesh_plan import LLAMA_70B, TWO_BY_TWO, h100_request, tiny_request


def four_nodes(inter_gbs: float) -> Cluster:
    return Cluster(nodes=4, gpus_per_node=8, intra_node_bytes_per_s=900e9,
                   inter_node_bytes_per_s=inter_gbs * 1e9)


def test_send_recv_between_stages_by_hand():
    """M = 1e6 B from every rank of a stage to the next stage.

    * 2 stages on TWO_BY_TWO: a stage is one node (2 ranks), every boundary crosses nodes and a
      node's 2 ranks send at once: 2 x 1e6 / 10e9 = 200 us; 1e6 B across per rank.
    * 4 stages: a stage is 1 rank; the boundary inside a node takes 1e6 / 100e9 = 10 us, the one
      between the nodes 1 x 1e6 / 10e9 = 100 us: the slower sets the pace, 100 us.
    * one node of 4 GPUs, 2 stages: inside, 1e6 / 100e9 = 10 us."""
    two = pipeline_send(TWO_BY_TWO, stages=2, payload_bytes=1e6)
    assert (two.intra_bytes, two.inter_bytes, two.count) == (0.0, 1e6, 1)
    assert two.time_s == pytest.approx(200e-6)
    four = pipeline_send(TWO_BY_TWO, stages=4, payload_bytes=1e6)
    assert four.inter_bytes == 1e6 and four.time_s == pytest.approx(100e-6)
    node = Cluster(nodes=1, gpus_per_node=4, intra_node_bytes_per_s=100e9,
                   inter_node_bytes_per_s=10e9)
    one = pipeline_send(node, stages=2, payload_bytes=1e6)
    assert (one.intra_bytes, one.inter_bytes) == (1e6, 0.0)
    assert one.time_s == pytest.approx(10e-6)
    assert pipeline_send(TWO_BY_TWO, stages=1, payload_bytes=1e6).total_bytes == 0
    # Where a stage lives: whole nodes, or part of one.
    halves, eighths = stage_cluster(four_nodes(50), 2), stage_cluster(four_nodes(50), 8)
    assert (halves.nodes, halves.gpus_per_node) == (2, 8)
    assert (eighths.nodes, eighths.gpus_per_node) == (1, 4)
    with pytest.raises(ValueError, match="divisor of 32"):
        stage_cluster(four_nodes(50), 3)


def test_pipeline_step_time_by_hand():
    """2 stages of one node each on TWO_BY_TWO, ZeRO-3 over the node's 2 ranks (R 1, S 2),
    P = 1e6, TINY (2 layers, 3 units), global batch 8 of 1 x 100 tokens: D = 2, m = 4.

    A stage: 1 layer of 2, P_K = 5e5, ceil(3/2) = 2 units.
    compute per micro-batch = 6 x 5e5 x 100 / 0.5e12 = 600 us;
    ZeRO inside the node: gathers of 1e6 B send 0.5e6 (5 us each), the fp32 reduce-scatter of
    2e6 B sends 1e6 (10 us): 20 us + 3 x 2 units x 100 us latency = 620 us;
    overlapped: max(600, 620) + 0.25 x 600 = 770 us;
    send/recv: the activation 1 x 100 x 64 x 2 B = 12800 B forward and its gradient back, each
    2 x 12800 / 10e9 = 2.56 us + 100 us latency: 205.12 us;
    t_micro = 975.12 us; step = (m + K - 1) t_micro = 5 x 975.12 = 4875.6 us, of which the
    bubble (K-1)/(m+K-1) = 1/5. Sent per rank per step: 2 x 4 x 12800 B, all across nodes."""
    req = tiny_request(global_batch=8)
    assert EXPOSED_FRACTION == 0.25 and COLLECTIVE_LATENCY_S == 100e-6
    c = price_mesh(req, TWO_BY_TWO, MeshLayout(pipeline=2, replicate=1, shard=2),
                   checkpointing=False)
    assert c.grad_accum == 4 and c.stage_layers == 1
    assert c.times_s["compute"] == pytest.approx(4 * 600e-6)
    assert c.times_s["zero-comm"] == pytest.approx(4 * 620e-6)
    assert c.times_s["pipeline-p2p"] == pytest.approx(4 * 205.12e-6)
    assert c.step_s == pytest.approx(5 * 975.12e-6)
    assert c.bubble_fraction == pytest.approx(1 / 5)
    assert c.times_s["bubble"] == pytest.approx(c.step_s * 1 / 5)
    p2p = c.traffic["pipeline-p2p"]
    assert (p2p.inter_bytes, p2p.intra_bytes) == (2 * 4 * 12800, 0.0)
    assert c.to_dict()["pipeline_p2p_bytes"] == 2 * 4 * 12800
    assert c.tokens_per_step == 8 * 100


@pytest.mark.parametrize("m", [4, 8, 16, 64])
def test_the_bubble_is_in_the_step_time(m):
    """Everything per micro-batch is the same at every m; the step is (m + K - 1) of them."""
    layout = MeshLayout(pipeline=4, replicate=1, shard=8)
    req = h100_request(LLAMA_70B, global_batch=8 * m)
    c = price_mesh(req, four_nodes(50), layout, checkpointing=True)
    assert c.grad_accum == m
    assert c.bubble_fraction == pytest.approx(3 / (m + 3))
    per_micro = c.step_s / (m + 3)  # no replicate-reduce: R = 1
    assert c.times_s["bubble"] == pytest.approx(3 * per_micro)
    assert c.step_s - c.times_s["bubble"] == pytest.approx(m * per_micro)


# Captured from the planner before pipelines existed (commit 5b935fc): Llama-70B on 4 x 8 H100s,
# NVLink 900 GB/s, default request (global batch 32, micro-batch 1): (step s, need bytes).
BEFORE = {
    (50, MeshLayout(replicate=1, shard=32), True): (11.430157292293956, 55543257600),
    (50, MeshLayout(replicate=4, shard=8), False): (10.560099511015194, 214641469440),
    (50, MeshLayout(replicate=1, shard=32, hpz_partition_size=8, quantized_weights=True,
                    quantized_gradients=True), True): (3.805071720511001, 72787419648),
    (50, MeshLayout(replicate=1, shard=16, tensor=2), False): (21.36568800392269, 75695725056),
    (5, MeshLayout(replicate=1, shard=32, quantized_weights=True, quantized_gradients=True),
     True): (37.97669741367963, 55543257600),
    (5, MeshLayout(replicate=4, shard=8), False): (85.0548795583752, 214641469440),
}


@pytest.mark.parametrize("key", list(BEFORE), ids=lambda k: f"{k[0]}GBs-{k[1].name}-{k[2]}")
def test_no_pipeline_prices_as_before(key):
    inter, layout, ckpt = key
    c = price_mesh(h100_request(LLAMA_70B), four_nodes(inter), layout, checkpointing=ckpt)
    assert (c.step_s, c.need_bytes) == (pytest.approx(BEFORE[key][0], rel=1e-12), BEFORE[key][1])
    assert c.bubble_fraction == 0 and c.traffic["pipeline-p2p"].total_bytes == 0
    assert c.schedule is None


def test_memory_per_rank_falls_with_the_stages():
    """Shard over one node (S = 8), the rest of the 32 GPUs as stages or replicas (K x R = 4):
    the model states per rank are the ZeRO paper's 18 P/K / S bytes (fp32 gradients), 1/K of
    K = 1's; 1F1B's first stage keeps K micro-batches of L/K layers' checkpointed inputs
    (K x L/K x 2sbh), one layer's working set (34 sbh) and the head (4sbh + 4sbv fp32 logits)."""
    req = h100_request(LLAMA_70B)
    s, b, h, v, layers = 2048, 1, 8192, 32000, 80
    base = None
    for k in (1, 2, 4):
        c = price_mesh(req, four_nodes(50), MeshLayout(pipeline=k, replicate=4 // k, shard=8),
                       checkpointing=True)
        states = c.ledger.total_bytes
        assert states == pytest.approx(paper_bytes_per_device(req.numel / k, 3, 8, grad_bytes=4),
                                       rel=1e-6)
        base = base or states
        assert states == pytest.approx(base / k, rel=1e-6)
        assert c.micro_batches_in_flight == k and c.stage_layers == layers // k
        acts = k * (layers // k) * 2 * s * b * h + 34 * s * b * h + 4 * s * b * h + 4 * s * b * v
        assert c.activation_bytes == acts


def test_pipeline_wins_on_a_slow_link_and_loses_on_a_fast_one():
    """Llama-70B on 4 x 8 GPUs. At 5 GB/s per node every ZeRO layout crosses nodes each
    micro-step (or keeps a replica per node, which 70B cannot), while stages cross once per
    micro-batch with one activation: a pipeline wins by more than MIN_GAIN_FRACTION and is
    chosen. When a node's link carries what its NVLinks carry (8 x 900 GB/s), ZeRO's
    communication hides behind compute, the bubble is pure loss, and no pipeline is chosen."""
    slow = make_mesh_plan(h100_request(LLAMA_70B), four_nodes(5))
    best = slow.best
    no_pp = min((c for c in slow.candidates if c.fits and c.layout.pipeline == 1),
                key=lambda c: c.step_s)
    assert best.layout.pipeline > 1 and best.schedule == "1f1b"
    assert best.step_s * (1 + MIN_GAIN_FRACTION) < no_pp.step_s
    assert best.bubble_fraction == pytest.approx((best.layout.pipeline - 1)
                                                 / (best.grad_accum + best.layout.pipeline - 1))
    fast = make_mesh_plan(h100_request(LLAMA_70B), four_nodes(8 * 900))
    assert fast.best.layout.pipeline == 1
    fastest_pp = min(c.step_s for c in fast.candidates if c.fits and c.layout.pipeline > 1)
    assert fastest_pp > fast.best.step_s
    # Off: no pipeline is priced at all.
    off = make_mesh_plan(h100_request(LLAMA_70B, pipeline_degrees=()), four_nodes(5))
    assert {c.layout.pipeline for c in off.candidates} == {1}


def test_layouts_enumerate_the_stage_counts_that_fit():
    """Every divisor of the world size up to the layers, with m >= K micro-batches; the
    tie-break counts a pipeline as one more departure from flat ZeRO-3."""
    seen = {x.pipeline for x in mesh_layouts(h100_request(LLAMA_70B), four_nodes(50))}
    assert seen == {1, 2, 4, 8, 16, 32}
    # TINY has 2 layers; a global batch of 2 on 4 ranks leaves m = 1 at T = 1 and m = 2 at T = 2.
    tiny = mesh_layouts(tiny_request(global_batch=2), TWO_BY_TWO)
    assert {(x.pipeline, x.tensor) for x in tiny if x.pipeline > 1} == {(2, 2)}
    with pytest.raises(ValueError, match="exceed the model's 2 layers"):
        mesh_layouts(tiny_request(pipeline_degrees=(4,)), TWO_BY_TWO)
    with pytest.raises(ValueError, match="micro-batches per step"):
        mesh_layouts(tiny_request(global_batch=1, pipeline_degrees=(2,)), TWO_BY_TWO)
    with pytest.raises(ValueError, match="micro-batches per step"):
        price_mesh(tiny_request(global_batch=2), TWO_BY_TWO,
                   MeshLayout(pipeline=2, replicate=1, shard=2), checkpointing=False)
    with pytest.raises(ValueError, match="MeshLayout.pipeline"):
        MeshLayout(pipeline=0, replicate=1, shard=4)
    assert MeshLayout(pipeline=2, replicate=1, shard=2).complexity == 1
    assert MeshLayout(pipeline=2, replicate=1, shard=2).name == "pp 2 + flat 2"


def test_config_has_the_pipeline_mesh_and_section():
    req = tiny_request(global_batch=8)
    c = price_mesh(req, TWO_BY_TWO, MeshLayout(pipeline=2, replicate=1, shard=2),
                   checkpointing=False)
    cfg = mesh_config_dict(c, req)
    assert cfg["mesh"] == {"pipeline": 2, "replicate": 1, "shard": 2, "tensor": 1}
    assert list(cfg["mesh"]) == ["pipeline", "replicate", "shard", "tensor"]  # outermost first
    assert cfg["pipeline"] == {"schedule": "1f1b", "micro_batches": 4}
    assert cfg["gradient_accumulation_steps"] == 4
    flat = price_mesh(req, TWO_BY_TWO, MeshLayout(replicate=1, shard=4), checkpointing=False)
    assert "pipeline" not in mesh_config_dict(flat, req)
    assert "pipeline" not in mesh_config_dict(flat, req)["mesh"]


def test_plan_nodes_cli_prices_and_writes_a_pipeline(tmp_path, capsys):
    out = tmp_path / "infinity.json"
    args = ["plan", "--params", "70e9", "--nodes", "4", "--gpus-per-node", "8",
            "--intra-node-gbps", "900", "--inter-node-gbps", "5", "--gpu-memory-gb", "80",
            "--device-tflops", "989", "--device-mem-gbs", "3350"]
    assert cli.main(args + ["--out-native", str(out), "--json", "--all"]) == 0
    doc = json.loads(capsys.readouterr().out)
    written = json.loads(out.read_text())
    assert written == doc["config"] and doc["best"]["pipeline"] > 1
    k = written["mesh"]["pipeline"]
    assert k * written["mesh"]["replicate"] * written["mesh"]["shard"] \
        * written["mesh"]["tensor"] == 32
    assert written["pipeline"] == {"schedule": "1f1b",
                                   "micro_batches": written["gradient_accumulation_steps"]}
    best = doc["best"]
    assert best["bubble_fraction"] == pytest.approx((k - 1) / (best["gradient_accumulation_steps"]
                                                               + k - 1))
    assert best["pipeline_p2p_bytes"] > 0 and best["schedule"] == "1f1b"
    assert {c["pipeline"] for c in doc["candidates"]} == {1, 2, 4, 8, 16, 32}
    assert cli.main(args + ["--pipeline", "off", "--json", "--all"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {c["pipeline"] for c in doc["candidates"]} == {1}
    assert cli.main(args + ["--pipeline", "4", "--json", "--all"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {c["pipeline"] for c in doc["candidates"]} == {1, 4}
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "bubble" in text and "pp " in text and "<- chosen" in text
    assert cli.main(args + ["--pipeline", "3"]) == 2
    assert "--pipeline 3" in capsys.readouterr().err
    assert cli.main(args + ["--pipeline", "two"]) == 2
    assert "--pipeline" in capsys.readouterr().err
    assert math.isfinite(best["step_s"])
