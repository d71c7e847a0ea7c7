-- The routes an event's emitter knew: a process of an older release, which routes the
-- topic to fewer actors, must not relay an event emitted by a newer one (its other
-- routes' messages would never be written, and nothing would show it).
--   outbox.routes  the actor names the emitting process routed the topic to, as a JSON
--                  array (NULL: emitted before this column); a relay takes the event only
--                  if it routes the topic to each of them (or, once no live relay has for
--                  STANDMEET_OUTBOX_UNROUTED_MAX_AGE_S, to those it knows, saying so)
--   relays.routes  each topic a relay routes, with its actors ({"topic": ["actor", …]});
--                  an event no live relay can take shows as unrouted
ALTER TABLE standmeet.outbox ADD COLUMN IF NOT EXISTS routes jsonb;
ALTER TABLE standmeet.relays ADD COLUMN IF NOT EXISTS routes jsonb;
