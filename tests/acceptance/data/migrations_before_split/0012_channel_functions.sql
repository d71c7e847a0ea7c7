-- Channel names are spelt once in SQL: every statement that wakes a queue's consumers or a
-- queue's receipt waiters calls one of these functions (broker/sql.py spells the same
-- names for the Python side; a test binds the two). The enqueue channel keeps the name
-- dramatiq-pg used, so consumers of both see the same wake-ups during a migration.
CREATE OR REPLACE FUNCTION standmeet.enqueue_channel(queue_name text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT 'dramatiq.' || queue_name || '.enqueue' $$;

CREATE OR REPLACE FUNCTION standmeet.receipt_channel(queue_name text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT 'standmeet_receipts_' || queue_name $$;

CREATE OR REPLACE FUNCTION standmeet.outbox_channel() RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT 'standmeet_outbox'::text $$;
