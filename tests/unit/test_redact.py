"""broker.ops.redact.hidden_options: nested messages keep their shape, lose their arguments."""

from __future__ import annotations

import copy

import dramatiq
from dramatiq import group, pipeline
from dramatiq.brokers.stub import StubBroker

from broker.ops.redact import HIDDEN, hidden_options


def _stub_actors() -> tuple[StubBroker, dramatiq.Actor, dramatiq.Actor]:
    broker = StubBroker()

    @dramatiq.actor(broker=broker, actor_name="redact_step")
    def step(secret: str, token: str = "") -> None: ...

    @dramatiq.actor(broker=broker, actor_name="redact_done")
    def done(secret: str) -> None: ...

    return broker, step, done


def test_a_pipeline_steps_next_message_keeps_its_actor_and_loses_its_arguments() -> None:
    broker, step, _ = _stub_actors()
    pipe = pipeline([step.message("first-secret"), step.message("second-secret", token="kw-secret")],
                    broker=broker)
    options = pipe.messages[0].options
    assert "second-secret" in repr(options)  # the nested message really carries them

    hidden = hidden_options(options)

    assert "second-secret" not in repr(hidden) and "kw-secret" not in repr(hidden)
    assert hidden["pipe_target"]["args"] == HIDDEN and hidden["pipe_target"]["kwargs"] == HIDDEN
    assert hidden["pipe_target"]["actor_name"] == "redact_step"
    assert hidden["pipe_target"]["message_id"] == options["pipe_target"]["message_id"]


def test_group_completion_callbacks_lose_their_arguments() -> None:
    broker, step, done = _stub_actors()
    g = group([step.message("a")], broker=broker)
    g.add_completion_callback(done.message("callback-secret"))
    options = {"group_completion_uuid": "u", "group_completion_callbacks": g.completion_callbacks}

    hidden = hidden_options(options)

    assert "callback-secret" not in repr(hidden)
    assert hidden["group_completion_callbacks"][0]["args"] == HIDDEN
    assert hidden["group_completion_callbacks"][0]["actor_name"] == "redact_done"
    assert hidden["group_completion_uuid"] == "u"


def test_any_nested_dict_with_arguments_is_hidden_at_any_depth_and_the_input_is_untouched() -> None:
    options = {"retries": 2, "eta": 123, "custom": {"deeper": [{"kwargs": {"password": "p"}, "queue_name": "q"}]},
               "pipe_target": {"args": ["x"], "kwargs": {}, "options": {"pipe_target": {"args": ["inner-secret"]}}}}
    before = copy.deepcopy(options)

    hidden = hidden_options(options)

    assert options == before
    assert hidden["retries"] == 2 and hidden["eta"] == 123
    assert hidden["custom"]["deeper"][0] == {"kwargs": HIDDEN, "queue_name": "q"}
    assert "inner-secret" not in repr(hidden) and "'x'" not in repr(hidden)


def test_options_nested_deeper_than_the_stack_are_cut_not_raised() -> None:
    deep: dict[str, object] = {"leaf": "deep-secret"}
    for _ in range(10_000):
        deep = {"n": deep}

    hidden = hidden_options({"custom": deep})

    assert "deep-secret" not in repr(hidden)


def test_non_dict_options_give_an_empty_dict() -> None:
    assert hidden_options(None) == {}  # type: ignore[arg-type]
