-- How many runs of a message ended with no outcome: neither returned, nor failed, nor
-- asked to run later (its retry logic itself raised, or a middleware broke in its
-- after-hooks). Such a run is run again, and the message is rejected with the reason once
-- STANDMEET_MAX_RUNS_WITHOUT_OUTCOME runs ended so. A constant default: no table rewrite.
ALTER TABLE dramatiq.queue ADD COLUMN IF NOT EXISTS runs_without_outcome integer NOT NULL DEFAULT 0;
