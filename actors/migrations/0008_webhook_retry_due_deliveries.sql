-- A webhook delivery attempted before (retried after a failure, or replayed) waits for its
-- back-off, then for its endpoint's lease as a never-attempted one does: giving the lease
-- back wakes the endpoint's oldest waiting delivery whose back-off has elapsed, retried
-- ones included, and a fan-out parks its jobs behind one that is due. This index finds
-- those whose back-off has elapsed (a replayed one has none: due now, -infinity) without
-- reading the endpoint's delivered history, nor the deliveries still waiting out their
-- back-off; it holds only the pending deliveries attempted at least once
-- (webhook_deliveries_due_idx holds those never attempted).
CREATE INDEX IF NOT EXISTS webhook_deliveries_retry_due_idx
    ON standmeet.webhook_deliveries (endpoint_id, (coalesce(next_attempt_at, '-infinity'::timestamptz)))
    WHERE state = 'pending' AND attempts > 0;
