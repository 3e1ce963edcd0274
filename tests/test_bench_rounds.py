"""The benchmark harness interleaves a case's rows (fastgrad/benchmarks/runner.run_rows): round 1
row by row (each row's warm-up, then a timed call), then one call of every row per round, the order
reversed every other round, so the rows of one round share the machine's moment (docs/benchmarks.md)."""

import time

from fastgrad.benchmarks import cases as C
from fastgrad.benchmarks import runner as R


def _case(calls, slow=None, fail=None, n=3):
    def runner(name):
        made = []

        def make(inp):
            made.append(1)
            k = len(made)

            def fn():
                if fail == name and k > 1:
                    raise RuntimeError("boom")
                calls.append((name, k))
                if slow == name:
                    time.sleep(0.02)

            return fn

        return C.Runner(name, "baseline", make)

    names = [f"r{i}" for i in range(n)]
    case = C.Case("smooth_l1_loss_backward", "mean", "float32", {"n": 1}, dict, [runner(x) for x in names])
    return case, [(i, x) for i, x in enumerate(names)]


def test_round_one_row_by_row_then_interleaved_rounds_alternating():
    calls = []
    case, specs = _case(calls)
    rows = R.run_rows(case, specs, {}, 1, 4, 1e9)
    # round 1: each row's first callable, warm-up + timed call, one row after the other
    assert calls[:6] == [("r0", 1), ("r0", 1), ("r1", 1), ("r1", 1), ("r2", 1), ("r2", 1)]
    # then each row made again, one untimed call each, in row order
    assert calls[6:9] == [("r0", 2), ("r1", 2), ("r2", 2)]
    # rounds 2, 3, 4: reversed, forward, reversed
    assert [c[0] for c in calls[9:]] == ["r2", "r1", "r0", "r0", "r1", "r2", "r2", "r1", "r0"]
    assert all(r["status"] == "ok" and r["reps"] == 4 for r in rows)
    assert all(r["time_p20_s"] <= r["time_median_s"] <= r["time_p80_s"] for r in rows)
    assert all(len(r["time_samples_s"]) == 4 and min(r["time_samples_s"]) <= r["time_median_s"] for r in rows)


def test_rounds_stop_once_a_row_has_spent_the_budget():
    calls = []
    case, specs = _case(calls, slow="r1")
    rows = R.run_rows(case, specs, {}, 1, 50, 0.05)
    reps = {r["runner"]: r["reps"] for r in rows}
    assert len(set(reps.values())) == 1      # whole rounds: every row the same number of calls
    assert 2 <= reps["r1"] <= 4              # r1's 20 ms calls reach 50 ms after 3 (±1 for timing)


def test_a_row_failing_in_a_later_round_keeps_round_one_and_says_why():
    calls = []
    case, specs = _case(calls, fail="r1")
    rows = R.run_rows(case, specs, {}, 1, 3, 1e9)
    assert all(r["status"] == "ok" and r["reps"] == 1 for r in rows)
    assert all("rounds stopped: RuntimeError: boom" in r["note"] for r in rows)


def test_one_repetition_is_round_one_only():
    calls = []
    case, specs = _case(calls, n=2)
    rows = R.run_rows(case, specs, {}, 1, 1, 1e9)
    assert calls == [("r0", 1), ("r0", 1), ("r1", 1), ("r1", 1)] and [r["reps"] for r in rows] == [1, 1]
