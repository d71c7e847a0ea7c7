-- replaces runtime migration 0006_suppliers_reindex_sources: a database migrated before the application's tables
-- left the runtime's migrations has this recorded as applied, and is not migrated again.
-- Calls to suppliers' APIs (notify queue): the request and its outcome.
CREATE TABLE IF NOT EXISTS standmeet.supplier_calls (
    id            bigserial PRIMARY KEY,
    supplier      text NOT NULL,
    url           text NOT NULL,
    payload       jsonb NOT NULL DEFAULT '{}',
    created_at    timestamptz NOT NULL DEFAULT now(),
    attempts      integer NOT NULL DEFAULT 0,
    status        text NOT NULL DEFAULT 'pending',   -- pending | succeeded | failed
    status_code   integer,
    response      text,
    error         text,
    finished_at   timestamptz
);

-- Index rebuilds: where each one is, so an interrupted one resumes.
CREATE TABLE IF NOT EXISTS standmeet.reindex_runs (
    id                bigserial PRIMARY KEY,
    started_at        timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz,
    last_document_id  bigint NOT NULL DEFAULT 0,
    indexed           integer NOT NULL DEFAULT 0,
    announced_at      timestamptz   -- when the index.rebuilt subscribers ran
);
CREATE TABLE IF NOT EXISTS standmeet.reindex_batches (
    run_id      bigint NOT NULL REFERENCES standmeet.reindex_runs (id) ON DELETE CASCADE,
    first_id    bigint NOT NULL,
    last_id     bigint NOT NULL,
    documents   integer NOT NULL,
    done_at     timestamptz NOT NULL DEFAULT now()
);

-- Job boards: sources, their postings, and the one pending fetch per source.
CREATE TABLE IF NOT EXISTS standmeet.job_sources (
    id              bigserial PRIMARY KEY,
    url             text NOT NULL UNIQUE,
    kind            text NOT NULL CHECK (kind IN ('json', 'rss')),
    time_limit_s    double precision NOT NULL DEFAULT 60,
    etag            text,
    last_modified   text,
    last_fetch_at   timestamptz,
    last_status     text,
    last_error      text,
    postings        integer NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS standmeet.job_postings (
    source_id     bigint NOT NULL REFERENCES standmeet.job_sources (id) ON DELETE CASCADE,
    external_id   text NOT NULL,
    title         text NOT NULL,
    url           text,
    published     text,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source_id, external_id)
);
-- At most one fetch per source queued or running: the primary key, not a check-then-insert.
CREATE TABLE IF NOT EXISTS standmeet.source_fetches (
    source_id    bigint PRIMARY KEY REFERENCES standmeet.job_sources (id) ON DELETE CASCADE,
    message_id   uuid NOT NULL,
    enqueued_at  timestamptz NOT NULL DEFAULT now()
);
