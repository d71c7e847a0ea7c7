-- Which worker process rescue last blamed a message's crash on. A process that was only
-- cut off (a network partition) and stepped down, not crashed, takes back the blame
-- rescue laid on its claims when it can reach the database again.
ALTER TABLE dramatiq.queue ADD COLUMN IF NOT EXISTS blamed_worker uuid;
