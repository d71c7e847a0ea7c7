-- The transactional outbox: events written in the application's transaction, turned
-- into messages by the relay. relay_txid records which relay transaction took each
-- row, so "no pass claims more than 200 rows" can be checked from the rows.
CREATE TABLE IF NOT EXISTS standmeet.outbox (
    id           bigserial PRIMARY KEY,
    topic        text NOT NULL,
    payload      jsonb NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    relayed_at   timestamptz,
    relay_txid   bigint,
    messages     integer,
    error        text
);

-- What the relay claims: pending rows, oldest first.
CREATE INDEX IF NOT EXISTS outbox_pending_idx ON standmeet.outbox (id)
    WHERE relayed_at IS NULL AND error IS NULL;
-- What pruning deletes: relayed rows by age.
CREATE INDEX IF NOT EXISTS outbox_relayed_idx ON standmeet.outbox (relayed_at)
    WHERE relayed_at IS NOT NULL;
