-- Dramatiq's result backend and rate-limiter backend, kept in Postgres.
--
-- Both tables hold short-lived keys: a row whose expires_at has passed (by the
-- database's clock) is treated as absent by every read, and the maintenance job
-- deletes such rows in batches. Waiters are woken by NOTIFY, not by polling these
-- tables (channels standmeet_results and standmeet_rate_limits).

-- One row per message whose result (or failure) is stored: the value is the
-- encoder's bytes exactly as Dramatiq produced them, whatever the encoder.
CREATE TABLE IF NOT EXISTS standmeet.results (
    message_key  text PRIMARY KEY,
    value        bytea NOT NULL,
    expires_at   timestamptz NOT NULL
);

-- What pruning deletes: expired rows, oldest first.
CREATE INDEX IF NOT EXISTS results_expires_at_idx ON standmeet.results (expires_at);

-- One row per rate-limiter key: a counter (concurrent limiter, window buckets,
-- barrier parties) or an event (a barrier's "cleared" mark, counting notifications).
CREATE TABLE IF NOT EXISTS standmeet.rate_limits (
    key          text PRIMARY KEY,
    value        bigint NOT NULL,
    expires_at   timestamptz NOT NULL
);

CREATE INDEX IF NOT EXISTS rate_limits_expires_at_idx ON standmeet.rate_limits (expires_at);
