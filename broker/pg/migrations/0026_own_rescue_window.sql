-- Each worker process and relay records the rescue window it was started with
-- (STANDMEET_RESCUE_AFTER_S; a relay, at least twice its heartbeat's pace): it steps
-- down within that window once it cannot prove it lives, so no other process may judge
-- it dead sooner. A judge takes the longer of its own window and the judged row's. In a
-- fleet whose processes were started with different windows (a rolling deploy that
-- changes the setting), a process with a short window rescued the jobs of a live
-- process with a long one, which still ran them: run twice. NULL: a row of an older
-- release, judged by the judge's window alone, as before. Nullable, no default: no rewrite.
ALTER TABLE standmeet.worker_processes ADD COLUMN IF NOT EXISTS rescue_after_s float8;
ALTER TABLE standmeet.relays ADD COLUMN IF NOT EXISTS rescue_after_s float8;
