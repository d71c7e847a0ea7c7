-- Every job leaves two or three dead row versions in dramatiq.queue (its claim, its
-- start mark if it was prefetched, its settle) and the claim index keeps an entry per
-- version until a vacuum removes it. With the default thresholds (20 % of the table) a
-- drain of a million jobs waited for 200,000 dead rows before the first vacuum. Vacuum
-- this table after 1 % of it (and at least 2,000 rows) has changed, with less sleeping
-- between its pages, and keep its statistics as fresh.
ALTER TABLE dramatiq.queue SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 2000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 1,
    autovacuum_analyze_scale_factor = 0.02
);
