"""bench scale's 7B LoRA row comes from a benchmarks/lora_7b.py record, figures unchanged."""

from __future__ import annotations

import json

import pytest

from infinity.bench.scale import _lora_record_path, lora_row


def test_lora_row_reports_the_record_figures(tmp_path):
    record = {"shape": "7b", "median_step_s": {"plain": 12.0, "ours": 13.2}, "x_plain": 1.1,
              "ours": {"peak_rss_bytes": 5 * 10**9, "setup_s": 100.0,
                       "nvme_read_per_step_bytes": 24.6e9}}
    older, newer = tmp_path / "lora7b-20260101-000000.json", tmp_path / "lora7b-20261203-172457.json"
    older.write_text(json.dumps({**record, "x_plain": 9.9}))
    newer.write_text(json.dumps(record))
    path = _lora_record_path("latest", str(tmp_path))
    assert path == str(newer)
    row = lora_row(path, ram=20 * 10**9)
    assert row["x plain"] == 1.1 and row["step s"] == 13.2 and row["plain step s"] == 12.0
    assert row["peak RSS GB"] == 5.0 and row["peak RSS / RAM"] == 0.25
    assert row["NVMe read GB/step"] == 24.6
    assert "x roofline" not in row  # a record from before the script probed the disk
    newer.write_text(json.dumps({**record, "roofline": {"x_roofline": 1.084}}))
    assert lora_row(path, ram=20 * 10**9)["x roofline"] == 1.08


def test_latest_without_a_record_names_the_folder(tmp_path):
    with pytest.raises(ValueError, match="lora7b"):
        _lora_record_path("latest", str(tmp_path))
