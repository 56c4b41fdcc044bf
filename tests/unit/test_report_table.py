"""The benchmarks' text table: every row's columns are shown, missing cells as '-'."""

from __future__ import annotations

from infinity.bench.report import format_table


def test_a_row_with_its_own_columns_keeps_them():
    rows = [{"params": "1.03B", "step s": 15.3},
            {"params": "7B LoRA", "step s": 15.6, "x plain": 1.36}]
    header, _sep, first, second = format_table(rows).splitlines()
    assert header.split() == ["params", "step", "s", "x", "plain"]
    assert first.split() == ["1.03B", "15.300", "-"]
    assert second.split() == ["7B", "LoRA", "15.600", "1.360"]


def test_explicit_columns_choose_and_order():
    rows = [{"a": 1, "b": 2.5}]
    assert format_table(rows, columns=["b"]).splitlines()[2].split() == ["2.500"]
    assert format_table([]) == "(no rows)"
