-- A job source's time limit is a finite number of seconds, above 0 and at most an hour:
-- a NaN, an infinity or a 0 once made fetch-new fail for every source. Rows written
-- before this check get the default back. (Postgres orders NaN above every number,
-- so "<= 3600" alone would let it through: it is named.)
UPDATE standmeet.job_sources SET time_limit_s = 60
WHERE time_limit_s = 'NaN'::float8 OR NOT (time_limit_s > 0 AND time_limit_s <= 3600);
ALTER TABLE standmeet.job_sources DROP CONSTRAINT IF EXISTS job_sources_time_limit_s_check;
ALTER TABLE standmeet.job_sources ADD CONSTRAINT job_sources_time_limit_s_check
    CHECK (time_limit_s <> 'NaN'::float8 AND time_limit_s > 0 AND time_limit_s <= 3600);
