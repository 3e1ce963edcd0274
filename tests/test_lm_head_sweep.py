"""The LM-head loop's row-major order (``kernels/_lm_head.run_row_blocks``) and its sweeps
(``_lm_head.sweep``): which tasks run between which barriers, in which order.

A sweep's steps are asked for their tasks once per chunk; chunk by chunk each step is its own
barrier, in stages stage ``t`` holds step ``k`` of chunk ``t - k`` for every ``k`` (the lead step's
tasks first) — so a chunk's step always runs after its previous step's barrier.  The training
loss's results under both schedules are compared in tests/test_linear_cross_entropy_staged.py.
"""

import itertools

import pytest

from fastgrad.lm_head import loop as _lm_head


def _record(monkeypatch):
    """Each barrier (``run_tasks`` call) as the list of its tasks' labels, tasks run in order."""
    barriers = []

    def run_tasks(tasks, engine="blas"):
        assert engine == "blas"
        barriers.append([t() for t in tasks])

    monkeypatch.setattr(_lm_head, "run_tasks", run_tasks)
    return barriers


def _steps(n_steps, asked, tasks_per_step=2):
    def step(k):
        def tasks(c):
            asked.append((k, c))
            return [(lambda i=i: (k, c, i)) for i in range(tasks_per_step)]

        return tasks

    return tuple(step(k) for k in range(n_steps))


@pytest.mark.parametrize("n,n_steps", [(1, 1), (1, 3), (4, 2), (5, 3), (3, 4)])
def test_chunk_by_chunk_is_one_barrier_per_step(n, n_steps, monkeypatch):
    barriers = _record(monkeypatch)
    asked = []
    _lm_head.sweep(_lm_head.Sweep(n, _steps(n_steps, asked)), "blas")
    assert barriers == [[(k, c, 0), (k, c, 1)] for c in range(n) for k in range(n_steps)]
    assert asked == [(k, c) for c in range(n) for k in range(n_steps)]


@pytest.mark.parametrize("n,n_steps,lead", [(1, 3, 1), (4, 2, 1), (5, 3, 1), (5, 3, 0), (3, 4, 2), (2, 1, 0)])
def test_staged_runs_step_k_of_chunk_t_minus_k(n, n_steps, lead, monkeypatch):
    barriers = _record(monkeypatch)
    asked = []
    _lm_head.sweep(_lm_head.Sweep(n, _steps(n_steps, asked), staged=True, lead=lead), "blas")
    assert len(barriers) == n + n_steps - 1
    stage_of = {}
    for t, labels in enumerate(barriers):
        pairs = [(k, c) for k, c, _ in labels]
        assert {p for p in pairs} == {(k, t - k) for k in range(n_steps) if 0 <= t - k < n}
        # each step's tasks together, the lead step's first, then the others in step order
        steps_in_order = [k for k, _ in itertools.groupby(k for k, _ in pairs)]
        expect = [k for k in [lead] + [j for j in range(n_steps) if j != lead] if 0 <= t - k < n]
        assert steps_in_order == expect
        for p in set(pairs):
            stage_of[p] = t
    # every (step, chunk) once; a chunk's step after its previous step's barrier
    assert sorted(stage_of) == sorted(itertools.product(range(n_steps), range(n)))
    for k, c in stage_of:
        if k:
            assert stage_of[(k, c)] > stage_of[(k - 1, c)]
    # asked once each, stage by stage (a step may record what the chunk's next step reads)
    assert sorted(asked) == sorted(stage_of) and len(asked) == len(stage_of)
    assert [stage_of[p] for p in asked] == sorted(stage_of[p] for p in asked)


def test_no_chunks_no_barrier(monkeypatch):
    barriers = _record(monkeypatch)
    for staged in (False, True):
        _lm_head.sweep(_lm_head.Sweep(0, _steps(3, []), staged=staged, lead=1), "blas")
    assert barriers == []


def test_a_lead_outside_the_steps_is_refused(monkeypatch):
    _record(monkeypatch)
    with pytest.raises(ValueError, match="lead"):
        _lm_head.sweep(_lm_head.Sweep(2, _steps(2, []), staged=True, lead=2), "blas")


class _Plan:
    def row_blocks(self):
        return iter([(0, 3), (3, 7), (7, 10)])


class _Epilogue:
    def __init__(self, log, grad_on):
        self.log, self.grad_on = log, grad_on

    def begin_rows(self, b0, b1):
        self.log.append(("begin_rows", b0, b1))
        self.b0 = b0

    def statistics(self):
        return _lm_head.Sweep(2, (lambda c: [lambda: self.log.append(("stats", self.b0, c))],), staged=True)

    def end_statistics(self):
        self.log.append(("end_statistics", self.b0))
        if self.b0 not in self.grad_on:
            return None
        return _lm_head.Sweep(2, (lambda c: [lambda: self.log.append(("grad", self.b0, c))],))

    def end_rows(self):
        self.log.append(("end_rows", self.b0))


def test_run_row_blocks_calls_the_epilogue_per_row_block():
    log, seen = [], []
    _lm_head.run_row_blocks(_Plan(), _Epilogue(log, grad_on={0, 7}), "blas", progress=lambda d, n: seen.append((d, n)))
    expect = []
    for b0, b1 in [(0, 3), (3, 7), (7, 10)]:
        expect += [("begin_rows", b0, b1), ("stats", b0, 0), ("stats", b0, 1), ("end_statistics", b0)]
        if b0 in (0, 7):
            expect += [("grad", b0, 0), ("grad", b0, 1)]
        expect.append(("end_rows", b0))
    assert log == expect
    assert seen == [(1, 3), (2, 3), (3, 3)]
