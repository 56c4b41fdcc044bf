"""``infinity bench comm`` part A: one step of flat ZeRO-3 on 2 gloo processes, its collective
bytes per kind read from ``engine.stats()`` into the bench record."""

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
