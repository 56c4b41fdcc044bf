"""``infinity bench io`` runs end to end at a tiny size (no timing is asserted, only the shape)."""

from __future__ import annotations

import builtins
import json
import os

import pytest

from infinity.bench import io as bench_io
from infinity.cli import main


def test_bench_io_small_json(tmp_path, capsys):
    rc = main(["bench", "io", "--dir", str(tmp_path / "d"), "--size-bytes", str(3 * 2**20 + 5),
               "--repeats", "1", "--no-fio", "--no-deepspeed", "--json", "--no-save"])
    assert rc == 0
    record = json.loads(capsys.readouterr().out)
    names = [r["engine"] for r in record["rows"]]
    assert names == ["infinity swapper", "raw direct I/O probe", "raw, reads and writes at once"]
    for row in record["rows"]:
        assert row["write_GBps"] > 0 and row["read_GBps"] > 0
    assert record["rows"][1]["ours/ref write"].endswith("x")
    assert os.listdir(tmp_path / "d") == []  # swap dir, probe file and references cleaned up


def test_plot_without_matplotlib_says_so(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    msg = bench_io._plot([], str(tmp_path / "x.png"))
    assert "matplotlib is not installed" in msg
    assert not (tmp_path / "x.png").exists()


def test_bench_io_rejects_bad_sizes(tmp_path):
    with pytest.raises(SystemExit):
        main(["bench", "io", "--size-bytes", "zero"])
    assert main(["bench", "io", "--dir", str(tmp_path), "--size-bytes", "0", "--no-save"]) == 2
