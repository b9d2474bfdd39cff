"""Which checkpoints retention gives up: the newest periodic ones and the best by metric stay,
the final one always stays, ties go to the earlier step, and records already deleted are
left alone."""

from __future__ import annotations

import pytest

from tinker_local.rl.checkpoints import BEST, FINAL, PERIODIC, CheckpointRecord, retention_plan


def _record(step, metric=None, kind=PERIODIC, deleted=False):
    return CheckpointRecord(
        step=step, state_path=f"tinker://r/weights/{kind}-{step}", data_cursor=step,
        kind=kind, final=kind == FINAL, metric=metric, deleted=deleted,
    )  # fmt: skip


def _steps(records):
    return sorted(r.step for r in records)


def test_keep_last_and_best_by_a_higher_is_better_metric():
    records = [_record(1, 0.2), _record(2, 0.9), _record(3, 0.5), _record(4, 0.1), _record(5)]
    records.append(_record(6, 0.3, kind=FINAL))
    doomed = retention_plan(records, keep_last=2, keep_best=1, higher_is_better=True)
    assert _steps(doomed) == [1, 3]  # kept: 2 (best), 4 and 5 (newest), 6 (final)
    doomed = retention_plan(records, keep_last=1, keep_best=2, higher_is_better=True)
    assert _steps(doomed) == [1, 4]  # kept: 2 and 3 (best two), 5 (newest), 6 (final)


def test_lower_is_better_ranks_the_other_way_and_ties_keep_the_earlier_step():
    records = [_record(1, 0.5), _record(2, 0.5), _record(3, 0.7), _record(4)]
    doomed = retention_plan(records, keep_last=1, keep_best=1, higher_is_better=False)
    assert _steps(doomed) == [2, 3]
    doomed = retention_plan(records, keep_last=1, keep_best=1, higher_is_better=True)
    assert _steps(doomed) == [1, 2]


def test_keep_best_ranks_only_its_kind_and_deleted_records_are_not_doomed_again():
    records = [
        _record(2, 1.4, kind=BEST), _record(4, 1.1, kind=BEST), _record(4), _record(6),
        _record(1, deleted=True),
    ]  # fmt: skip
    doomed = retention_plan(
        records, keep_last=1, keep_best=1, higher_is_better=False, ranked_kind=BEST
    )
    assert [(r.kind, r.step) for r in doomed] == [(BEST, 2), (PERIODIC, 4)]


@pytest.mark.parametrize("keep_last", [None, 1])
def test_the_newest_periodic_checkpoint_is_always_kept(keep_last):
    records = [_record(1, 0.9), _record(2, 0.1)]
    doomed = retention_plan(records, keep_last=keep_last, keep_best=0, higher_is_better=True)
    assert _steps(doomed) == [1]
