"""An actor whose options its runs could not use is refused as it is declared, in one
line naming the actor, the option and the value: unchecked, the policy's before-hook
raised at every run, and Dramatiq logged it and ran the job without that policy (a
time limit of 'abc' ran with no limit at all)."""

from __future__ import annotations

import dramatiq
import pytest

from broker.errors import ConfigError


@pytest.mark.parametrize("options, said", [
    ({"time_limit": "abc"}, "option time_limit='abc' is not a number from 1 to"),
    ({"time_limit": -5}, "option time_limit=-5 is not a number from 1 to"),
    ({"max_snoozes": "5"}, "option max_snoozes='5' is not a whole number from 0 to"),
    ({"max_retries": 2.5}, "option max_retries=2.5 is not a whole number from 0 to"),
    ({"min_backoff": float("nan")}, "option min_backoff=nan is not a number from 0 to"),
    ({"max_age": True}, "option max_age=True is not a number from 1 to"),
])
def test_an_actor_with_an_option_its_runs_cannot_use_is_refused_as_it_is_declared(make_broker, options, said):
    make_broker()
    with pytest.raises(ConfigError, match="^actor 'refused_actor': " + said.replace("(", r"\(")):
        dramatiq.actor(actor_name="refused_actor", queue_name="mem_refused", **options)(lambda: None)


def test_an_actor_with_usable_options_is_declared(make_broker):
    broker = make_broker()

    @dramatiq.actor(queue_name="mem_usable", time_limit=1_000, max_retries=None, max_snoozes=3, result_ttl=None,
                    min_backoff=0, priority=-10)
    def usable() -> None:
        pass

    assert "usable" in broker.actors
