-- A message can be woken while it runs: a job that is about to snooze (waiting for
-- something another job is finishing, e.g. a webhook endpoint's lease) is then made due
-- at once by its snooze's settle instead of sleeping out its snooze. Set by the waker,
-- read by the settle, cleared by the next claim. Nullable, no default: no rewrite.
ALTER TABLE dramatiq.queue ADD COLUMN IF NOT EXISTS woken_at timestamptz;
