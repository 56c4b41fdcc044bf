"""``infinity bench scale``: one fresh ``infinity train --params N`` process per size, and its row.

Checked against the summaries the rows come from (bytes and seconds carried over, the ratios
recomputed here from their parts) and against the ledger's formula for the state size."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from infinity.bench import scale


def test_sizes_parse_and_quick_stops_at_1b():
    import argparse

    args = argparse.Namespace(sizes="1e8,3e8,1e9,3.3e9", quick=True)
    assert scale._sizes(args) == [1e8, 3e8, 1e9]
    with pytest.raises(ValueError, match="--sizes"):
        scale._sizes(argparse.Namespace(sizes="1e8,big", quick=False))
    with pytest.raises(ValueError, match="no size"):
        scale._sizes(argparse.Namespace(sizes="3.3e9", quick=True))


def test_one_row_per_size_from_its_own_process(tmp_path):
    out = subprocess.run([sys.executable, "-m", "infinity", "bench", "scale", "--sizes", "1e7",
                          "--steps", "2", "--dtype", "fp32", "--seq-len", "16", "--host-budget", "auto", "--dir", str(tmp_path),
                          "--json", "--no-save"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads(out.stdout[out.stdout.index("{"):])
    (row,), (summary,) = record["rows"], record["summaries"]
    assert summary["steps"] == 2 and summary["offload"] == "nvme"
    assert summary["full_training_state_bytes"] >= 16 * summary["num_params"]  # fp32: 4+4+12 B
    assert row["peak RSS GB"] == round(summary["peak_rss_bytes"] / 1e9, 2) > 0
    line = summary["roofline"]
    assert row["x roofline"] == round(summary["median_step_s"] / line["roofline_s"], 2)
    assert line["roofline_s"] == max(line["cpu_s"], line["disk_s"])
    assert row["x staging bound (mean)"] == round(summary["mean_step_s"]
                                                  / line["mean"]["staging_bound_s"], 2)


def test_plot_draws_the_rows_against_their_bounds():
    """--plot: RSS and the ratios are the rows' own numbers, beside the issue's bounds."""
    plt = pytest.importorskip("matplotlib.pyplot")
    rows = [{"params": "0.10B", "peak RSS GB": 3.1, "x roofline": 1.1, "NVMe x min": 0.95},
            {"params": "1.00B", "peak RSS GB": 3.4, "x roofline": 1.2, "NVMe x min": 1.0},
            {"params": "3.3e+09", "error": "killed"},
            {"params": "7B LoRA (7b)", "peak RSS GB": 5.2, "x roofline": 1.12,
             "record": "lora7b-20261204-235425.json"}]  # not on the size axis
    fig = scale._draw(plt, rows, ram_bytes=24 * 2**30)
    try:
        rss, speed = fig.axes
        (line, bound) = rss.get_lines()
        assert list(line.get_xdata()) == [0.1, 1.0] and list(line.get_ydata()) == [3.1, 3.4]
        assert list(bound.get_ydata()) == [0.25 * 24 * 2**30 / 1e9] * 2
        ratios = {ln.get_label(): list(ln.get_ydata()) for ln in speed.get_lines()}
        assert ratios["step / roofline"] == [1.1, 1.2]
        assert ratios["NVMe bytes / minimum"] == [0.95, 1.0]
        assert ratios["1.25x"] == [1.25, 1.25]
    finally:
        plt.close(fig)
