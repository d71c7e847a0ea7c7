-- A webhook delivery job that holds its endpoint's lease also delivers that endpoint's
-- next never-attempted pending deliveries, oldest first, over the same kept-alive
-- connection. This index finds them without reading the endpoint's delivered history;
-- it holds only the rows still waiting for a first attempt.
CREATE INDEX IF NOT EXISTS webhook_deliveries_due_idx
    ON standmeet.webhook_deliveries (endpoint_id, id) WHERE state = 'pending' AND attempts = 0;
