-- replaces runtime migration 0010_operations: a database migrated before the application's tables
-- left the runtime's migrations has this recorded as applied, and is not migrated again.
-- What the webhook views read: an endpoint's deliveries, newest first; a delivery's last attempt.
CREATE INDEX IF NOT EXISTS webhook_deliveries_endpoint_idx
    ON standmeet.webhook_deliveries (endpoint_id, updated_at DESC);
CREATE INDEX IF NOT EXISTS webhook_attempts_delivery_idx
    ON standmeet.webhook_attempts (delivery_id, attempt DESC);
