-- replaces runtime migration 0003_documents: a database migrated before the application's tables
-- left the runtime's migrations has this recorded as applied, and is not migrated again.
-- Documents written by the application, and the Postgres full-text index of them.
CREATE TABLE IF NOT EXISTS standmeet.documents (
    id          bigserial PRIMARY KEY,
    title       text NOT NULL DEFAULT '',
    body        text NOT NULL DEFAULT '',
    kind        text NOT NULL DEFAULT 'raw',
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS standmeet.search_index (
    document_id  bigint PRIMARY KEY REFERENCES standmeet.documents (id) ON DELETE CASCADE,
    title        text NOT NULL,
    tsv          tsvector NOT NULL,
    indexed_at   timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS search_index_tsv_idx ON standmeet.search_index USING gin (tsv);
