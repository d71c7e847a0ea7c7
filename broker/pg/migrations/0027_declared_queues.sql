-- The queues the application declares (broker.app.queue), as `migrate` last found them
-- in the modules it loaded: the operator's commands, which load no application module,
-- know them from here (pause a queue before any worker ran; `status --check` covers each
-- one with no live worker, jobs due or not). A `migrate` run with the application's modules
-- records their whole set: a queue they no longer declare is forgotten.
CREATE TABLE IF NOT EXISTS standmeet.declared_queues (
    name text PRIMARY KEY,
    declared_at timestamptz NOT NULL DEFAULT now()
);
