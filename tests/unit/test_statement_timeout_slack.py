"""The rule that lets a borrowed session keep its statement_timeout: never later than the
borrower's deadline, never earlier than the documented slack before it."""

from __future__ import annotations

import pytest

from broker.pg import db

NEEDS_MS = [1, 2, 9, 10, 50, 99, 100, 999, 1_000, 2_499, 2_500, 2_501, 15_000, 600_000]


@pytest.mark.parametrize("needed", NEEDS_MS)
def test_what_is_set_is_kept_at_once_and_stops_no_later_than_needed(needed):
    target = db._target_ms(needed)
    assert 1 <= target <= needed
    assert needed - target <= min(db.STATEMENT_TIMEOUT_SLACK_MS, needed // 10)
    assert db._keeps(target, needed)


@pytest.mark.parametrize("needed", NEEDS_MS)
def test_a_kept_timeout_is_never_over_what_remains_nor_more_than_the_slack_under_it(needed):
    slack = min(db.STATEMENT_TIMEOUT_SLACK_MS, needed // 10)
    for current in range(max(0, needed - 2 * slack - 5), needed + 6):
        assert db._keeps(current, needed) == (current != 0 and needed - slack <= current <= needed), current


def test_a_job_keeps_its_own_timeout_for_the_slack_then_sets_it_again():
    # Given a session set for a job with 15 s left
    target = db._target_ms(15_000)
    # Then the same job keeps it while up to the slack passes, and not after
    slack = db.STATEMENT_TIMEOUT_SLACK_MS
    assert db._keeps(target, 15_000 - slack)
    assert not db._keeps(target, 15_000 - slack - 1)


def test_no_limit_is_kept_only_by_no_limit():
    assert db._target_ms(0) == 0
    assert db._keeps(0, 0)
    assert not db._keeps(0, 15_000)  # a session without a limit never serves a job
    assert not db._keeps(15_000, 0)  # nor a job's limit a borrower without one
