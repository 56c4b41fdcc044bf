"""``infinity bench comm`` part A: one step of flat ZeRO-3 on 2 gloo processes, its collective
bytes per kind read from ``engine.stats()`` into the bench record; the pipeline modes (pp2, pp4)
on 4, their send/recv bytes against the formula."""

from __future__ import annotations

import json

import pytest

from infinity import cli

pytestmark = pytest.mark.distributed


def test_part_a_measures_flat_on_two_ranks(tmp_path, capsys):
    results = tmp_path / "results"
    rc = cli.main(["bench", "comm", "--ranks", "2", "--modes", "flat", "--steps", "1",
                   "--warmup", "0", "--seq-len", "16", "--models", "llama-7b",
                   "--mode-timeout-s", "180", "--json", "--results-dir", str(results)])
    record = json.loads(capsys.readouterr().out)
    assert rc == 0, record["measured"]
    (flat,) = record["measured"]
    assert flat["mode"] == "flat" and flat["status"] == "ok", flat
    # Stage 3 gathers every unit in forward and again in backward, and reduces its gradient.
    assert flat["forward-gather_bytes"] == flat["backward-gather_bytes"] > 0
    assert flat["reduce-grad_bytes"] > 0
    assert flat["total_bytes"] == sum(v for k, v in flat.items() if k.endswith("_bytes")
                                      and k != "total_bytes")
    assert flat["bytes_x_flat"] == 1.0 and flat["step_s"] > 0
    saved = json.loads(next(results.glob("comm-*.json")).read_text())
    assert saved["measured"] == record["measured"]


def test_part_a_pipeline_send_recv_bytes_equal_the_formula(tmp_path, capsys):
    """pp2 (PP=2 x DP=2, ZeRO-3 in each stage) and pp4 (PP=4 x DP=1) beside flat on 4 gloo
    processes, bf16, 1F1B over 4 micro-batches (of K x 2 / 4 sequences): each stage's send and
    receive bytes per step equal 2 directions x m x b x s x h x 2 B per boundary it sits on, split
    by neighbour (nothing to a stage that is not there); the bubble is (K - 1) / (m + K - 1); the
    ZeRO-3 gradient reduce-scatter of a stage runs once per micro-batch over its own parameters."""
    results = tmp_path / "results"
    rc = cli.main(["bench", "comm", "--ranks", "4", "--modes", "flat,pp2,pp4", "--steps", "2",
                   "--warmup", "1", "--seq-len", "16", "--models", "llama-7b",
                   "--mode-timeout-s", "240", "--json", "--results-dir", str(results)])
    record = json.loads(capsys.readouterr().out)
    assert rc == 0, record["measured"]
    rows = {r["mode"]: r for r in record["measured"]}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    flat = rows.pop("flat")
    assert "p2p_bytes" not in flat
    m, batch, seq, hidden = 4, 2, 16, 32  # --micro-batches, --batch-size, --seq-len, tiny's n_embd
    for k in (2, 4):
        micro_batch = k * batch // m  # a stage's rank takes K x --batch-size sequences a step
        one_way = m * micro_batch * seq * hidden * 2  # one boundary, one direction, bf16
        for s in range(k):
            row = rows[f"pp{k} stage {s}"]
            prev, nxt = s > 0, s < k - 1
            assert row["p2p_formula_bytes"] == 2 * one_way * (prev + nxt), row
            assert row["p2p_bytes"] == row["p2p_formula_bytes"]
            assert row["send_bytes"] == row["recv_bytes"] == one_way * (prev + nxt)
            for key in ("send_bytes_prev", "recv_bytes_prev"):
                assert row[key] == one_way * prev, (row["mode"], key)
            for key in ("send_bytes_next", "recv_bytes_next"):
                assert row[key] == one_way * nxt, (row["mode"], key)
            assert row["bubble_fraction"] == pytest.approx((k - 1) / (m + k - 1))
            assert row["data_parallel"] == 4 // k
            if k == 2:  # fp32 gradients of the stage's parameters, reduced per micro-batch
                assert row["reduce-grad_bytes"] == pytest.approx(
                    m * row["numel_x_flat"] * flat["reduce-grad_bytes"], rel=1e-9)
                assert row["bytes_x_flat"] == pytest.approx(m * row["micro_bytes_x_flat"])
            else:  # one rank per stage: no ZeRO collective, the norm over the stages alone
                assert "reduce-grad_bytes" not in row and row["norm_bytes"] > 0
    assert sum(rows[f"pp2 stage {s}"]["numel_x_flat"] for s in range(2)) > 1.0  # untied
