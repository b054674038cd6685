"""grpo_trainer.replay's comparison (issue 35): which metrics count, exact by default, a relative
tolerance, NaN on both sides. The replay itself on a real run: tests/integration/test_replay.py."""

from __future__ import annotations

import math

from grpo_trainer.replay import compare, table


def test_only_what_both_have_and_no_timings():
    logged = {"actor/pg_loss": 0.25, "actor/grad_norm": 1.5, "timing_s/step": 3.0, "val/score": 0.5}
    replayed = {"actor/pg_loss": 0.25, "actor/grad_norm": 1.5, "timing_s/step": 9.0, "perf/throughput": 1.0,
                "actor/kl_loss": 0.1}
    rows, differ = compare(logged, replayed, 0.0)
    assert [r[0] for r in rows] == ["actor/grad_norm", "actor/pg_loss"] and differ == []


def test_exact_by_default_and_relative_with_a_tolerance():
    logged, replayed = {"a/x": 1000.0, "a/y": 1e-9}, {"a/x": 1000.0 + 1e-9, "a/y": 2e-9}
    assert compare(logged, replayed, 0.0)[1] == ["a/x", "a/y"]
    assert compare(logged, replayed, 1e-6)[1] == []        # 1e-9 of 1000; 1e-9 below max(1, |logged|)
    assert compare({"a/x": 100.0}, {"a/x": 100.2}, 1e-3)[1] == ["a/x"]


def test_nan_matches_only_nan():
    assert compare({"a/x": math.nan}, {"a/x": math.nan}, 0.0)[1] == []
    assert compare({"a/x": math.nan}, {"a/x": 1.0}, 0.1)[1] == ["a/x"]
    assert compare({"a/x": 1.0}, {"a/x": math.nan}, 0.1)[1] == ["a/x"]


def test_the_table_shows_both_values_in_full_and_marks_a_difference():
    rows, _ = compare({"actor/grad_norm": 0.1 + 0.2}, {"actor/grad_norm": 0.3}, 0.0)
    text = table(rows)
    assert "0.30000000000000004" in text and "0.3 " in text and text.endswith("<- differs")
