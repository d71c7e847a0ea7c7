"""A periodic table for the scheduler tests: one short-interval job."""

import tests.support.jobs  # noqa: F401  (declares test.tick)
from periodic import PeriodicJob

JOBS = [PeriodicJob("test-every-second", "test.tick", interval_s=1.0, kwargs={"label": "periodic"})]

#: A job for an actor no module declares: the scheduler refuses it at start.
GHOST = [PeriodicJob("test-ghost", "test.no_such_actor", interval_s=5.0)]

#: Two jobs of one name: the scheduler refuses the table at start.
TWICE = [PeriodicJob("test-twice", "test.tick", interval_s=5.0, kwargs={"label": "a"}),
         PeriodicJob("test-twice", "test.tick", interval_s=7.0, kwargs={"label": "b"})]
