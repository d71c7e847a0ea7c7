-- replaces runtime migration 0016_webhook_delivery_messages: a database migrated before the application's tables
-- left the runtime's migrations has this recorded as applied, and is not migrated again.
-- Each webhook delivery names the message that carries it, so a job that makes the
-- delivery as part of an endpoint's batch can mark that message done while it is still
-- queued, instead of letting it run only to find its delivery made.
ALTER TABLE standmeet.webhook_deliveries ADD COLUMN IF NOT EXISTS message_id uuid;
