"""What the dashboard's overview shows of an operator's recorded action: a bulk action's
thousands of job ids are cut to a few and a count, anything else as it was recorded."""

from __future__ import annotations

from broker.dashboard.app import TARGET_IDS_SHOWN, brief_target


def test_a_recorded_target_with_many_job_ids_shows_the_first_few_and_how_many_more():
    ids = [f"id-{n}" for n in range(10_000)]
    shown = brief_target({"filter": {"state": "rejected"}, "message_ids": ids})
    assert shown == {"filter": {"state": "rejected"},
                     "message_ids": [*ids[:TARGET_IDS_SHOWN], f"… {10_000 - TARGET_IDS_SHOWN} more"]}


def test_a_short_or_other_target_is_shown_as_it_was_recorded():
    assert brief_target({"message_ids": ["a", "b"]}) == {"message_ids": ["a", "b"]}
    assert brief_target({"queue": "index"}) == {"queue": "index"}
    assert brief_target(None) is None
