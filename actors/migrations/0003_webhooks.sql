-- replaces runtime migration 0007_webhooks: a database migrated before the application's tables
-- left the runtime's migrations has this recorded as applied, and is not migrated again.
-- Webhooks: endpoints (with the delivery lease), events, deliveries and their attempts.
CREATE TABLE IF NOT EXISTS standmeet.webhook_endpoints (
    id               bigserial PRIMARY KEY,
    url              text NOT NULL,
    event_types      text[] NOT NULL,
    secrets          text[] NOT NULL,             -- whsec_…; every active one signs
    enabled          boolean NOT NULL DEFAULT true,
    busy_until       timestamptz,                 -- the lease: ≤ 1 delivery in flight
    lease_token      uuid,
    failing_since    timestamptz,
    disabled_reason  text,
    created_at       timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS standmeet.webhook_events (
    id          bigserial PRIMARY KEY,
    type        text NOT NULL,
    payload     jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS standmeet.webhook_deliveries (
    id               bigserial PRIMARY KEY,
    event_id         bigint NOT NULL REFERENCES standmeet.webhook_events (id) ON DELETE CASCADE,
    endpoint_id      bigint NOT NULL REFERENCES standmeet.webhook_endpoints (id) ON DELETE CASCADE,
    state            text NOT NULL DEFAULT 'pending'
                     CHECK (state IN ('pending', 'succeeded', 'failed', 'skipped')),
    attempts         integer NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz,
    last_outcome     text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (event_id, endpoint_id)
);
CREATE INDEX IF NOT EXISTS webhook_deliveries_failed_idx ON standmeet.webhook_deliveries (updated_at)
    WHERE state = 'failed';
CREATE TABLE IF NOT EXISTS standmeet.webhook_attempts (
    id             bigserial PRIMARY KEY,
    delivery_id    bigint NOT NULL REFERENCES standmeet.webhook_deliveries (id) ON DELETE CASCADE,
    attempt        integer NOT NULL,
    started_at     timestamptz NOT NULL,
    duration_ms    integer NOT NULL,
    status_code    integer,
    outcome        text NOT NULL,   -- ok | http | redirect | timeout | connect | dns | tls | blocked | gone
    error          text,
    response_body  text,
    truncated      boolean NOT NULL DEFAULT false
);
