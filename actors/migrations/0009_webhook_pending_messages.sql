-- The pending deliveries by the message that carries them: the reconciliation that fails
-- a pending delivery whose job was rejected (an operator's cancel, a job that crashed its
-- worker too often) finds it from the rejected job, and the hourly sweep reads only the
-- pending deliveries, not the delivered history.
CREATE INDEX IF NOT EXISTS webhook_deliveries_pending_message_idx
    ON standmeet.webhook_deliveries (message_id) WHERE state = 'pending';
