"""The one writer of message rows: every INSERT or COPY into ``dramatiq.queue`` is executed here.

Every way a message is written goes through this module, with one hook policy:

* **The hooks.** ``before_enqueue`` runs for each message before it is checked and
  written; it is skipped only where it would leave the message as it is: every hook is
  declared carrier-only (``broker.observability.tracing.carrier_only``) and there is no
  trace to carry, or the message carries one already (:func:`runs_before_hooks`).
  ``after_enqueue`` runs for each message once it is written: after the commit where
  this module commits, after the statement where the caller owns the transaction.
  A message with a unique key whose key is live is not written: the live message is
  returned, and is the one ``after_enqueue`` sees.
* **A send** (``actor.send()``, :meth:`StandmeetBroker.enqueue`, :func:`send`): hooks as
  above; one autocommit statement on the broker's pool.
* **A batch** (``broker.enqueue_many``, :func:`send_many`, :func:`enqueue_messages`):
  hooks as above, for each message. Those without a unique key are copied, all or none
  (``COPY_QUEUED``, fed a chunk of rows at a time by :class:`broker.engine.copy_rows.CopyBatch`),
  their queues woken (``WAKE_QUEUES``, at commit), in a transaction of a pooled connection,
  or under a savepoint of the caller's transaction when given a connection (a transaction
  of its own on an autocommit one outside any). Given a connection, every message is
  checked before the first statement; holding a unique key, before a connection is taken;
  otherwise the first chunk's before a connection is taken, and each later chunk's just
  before its rows are made, while Postgres stores the one before: a refused one ends the
  copy there and rolls the transaction back (nothing written, nobody woken, the same error
  raised, the server told nothing; the rows it had taken stay dead until vacuum). An id
  that exists already rolls the copy back, and ``ENQUEUE`` writes them, a chunk at a time,
  under the same rules as a send's. Sizes are bounded without encoding where they can be.
  Memory: beside the caller's messages (and a pointer or two per message), one chunk's
  rows at a time: at most ``copy_rows.CHUNK_MESSAGES`` (1,000) messages or ``CHUNK_CHARS``
  (1 MiB) of rows plus one message; 100,000 small messages in one call peak at 1.4 MiB of
  Python memory (tracemalloc), where the batch encoded whole took 70 MiB. Those with a
  unique key are written by :func:`unique_write`, in the same transaction, all in memory.
* **The caller's transaction** (:func:`enqueue`, :func:`enqueue_async`,
  :func:`enqueue_message`, :func:`enqueue_messages`): hooks as above; the message row
  and its NOTIFY are part of the caller's transaction (consumers are woken at commit, a
  rollback leaves nothing behind):

      with psycopg.connect(url) as conn, conn.transaction():
          conn.execute("INSERT INTO shop.orders …")
          enqueue(conn, "orders.confirm", order_id)

      async with await psycopg.AsyncConnection.connect(url) as aconn, aconn.transaction():
          await aconn.execute("INSERT INTO shop.orders …")
          await enqueue_async(aconn, "orders.confirm", order_id)

  ``actor.send()``, by contrast, commits on its own, outside any transaction of yours.
* **A run's after-hooks** (a retry, a snooze, a pipeline's next step, a callback:
  :func:`send_from_run`): hooks as above, at once; the message is checked now and written
  by the run's settle, in the settle's statement and transaction, only if the run is
  settled (``sql_enqueue.FOLLOWUPS_OF_SETTLED``, with ``codec.followup_params``). A retry or
  snooze of the run's own message is its settle's outcome, not a new row.
* **The relay** (:func:`relay_write`, :func:`relay_written`): a routed event's messages
  take the hooks as above, the event's trace counting as the message's own; those that
  need no hook are written as JSON text straight from the route, in the pass's transaction
  (statements of at most ``codec.WRITE_CHARS``); ``after_enqueue`` runs once it commits.
* :data:`FINISH_ONE_QUEUED` writes no message (it marks a queued one done, or rejected): no hook runs.

A message is checked before any statement of the caller's runs, as ``emit`` checks an event (a
batch's, every one of them before its first statement; a batch in a pooled connection's transaction
of its own, as its rows are copied, that transaction then rolled back), so a refused one leaves the
caller's transaction usable and the batch unwritten: its arguments must be JSON Postgres stores (no
NaN or infinity, ``\\u0000`` or lone surrogate: ``check_json_value``), its options values its run
can use, and its encoded size at most STANDMEET_MESSAGE_MAX_BYTES
(:class:`broker.errors.InvalidMessage`, :class:`broker.errors.MessageTooLarge`).

A message with a unique key (an actor's ``unique=``, a message's ``unique_key``) is
written by :func:`unique_write`'s statements, in one transaction with the others of its
batch. The sync and the async forms prepare and finish a send with the same functions
(:func:`prepare_send`, :func:`send_steps`, :func:`finish_send`); only the driver that
runs the statements differs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import dramatiq
import psycopg
from dramatiq.errors import BrokerConnectionError, QueueNotFound
from dramatiq.message import Message

from broker import app
from broker.engine import codec, sql, sql_enqueue
from broker.engine.codec import (
    as_message,
    batch_params,
    check_distinct_ids,
    delay_seconds,
    enqueue_one_params,
    enqueue_params,
    message_json,
    message_priority,
)
from broker.engine.copy_rows import CopyBatch
from broker.engine.unique import (
    Step,
    UniqueItem,
    UniqueKey,
    UniqueOutcome,
    any_unique_key,
    live_messages,
    split_unique,
    unique_item,
    unique_key_of,
)
from broker.errors import DatabaseError, MessageRefused
from broker.observability import tracing
from broker.pg.pool import DISCONNECTS
from broker.pg.preflight import first_line
from broker.services import current_broker

logger = logging.getLogger(f"standmeet.{__name__}")

if TYPE_CHECKING:
    from broker.engine.broker import StandmeetBroker
    from broker.engine.settler import SettleContext


# -- the hook policy ---------------------------------------------------------------------

#: Told the skips of each write that skipped ({(queue, actor): n}): ``broker.observability.metrics``
#: adds its counter here when it is imported (it imports this module, not the reverse).
SKIP_COUNTERS: list[Callable[[dict[tuple[str, str], int]], None]] = []
#: What may keep a skip count from being written (the database refused it, or is away).
_COUNT_FAILURES: tuple[type[BaseException], ...] = (psycopg.Error, *DISCONNECTS)


def count_skips(skipped: dict[tuple[str, str], int], broker: Any = None) -> None:
    """Count skipped sends: ``standmeet_unique_skipped_total{queue,actor}`` in this process,
    and ``standmeet.unique_skips`` on the broker's own autocommit connection (never the
    caller's transaction: its row lock would be held until that ends). A count that
    cannot be written is logged, never raised: the send itself succeeded."""
    if not skipped:
        return
    for counter in SKIP_COUNTERS:
        counter(skipped)
    keys = sorted(skipped)
    try:
        (broker or current_broker()).execute(sql_enqueue.UNIQUE_SKIPPED, {
            "queues": [k[0] for k in keys], "actors": [k[1] for k in keys], "counts": [skipped[k] for k in keys]})
    except _COUNT_FAILURES as exc:
        logger.warning("could not record %d skipped unique send(s): %s", sum(skipped.values()), exc)


def runs_before_hooks(broker: StandmeetBroker, *, carried: bool = False) -> bool:
    """Whether a message goes through the ``before_enqueue`` hooks: there are some, and
    one of them may change it (not every hook is carrier-only, or there is a trace to
    carry and the message does not carry one already: ``carried``)."""
    if not broker._hooks("before_enqueue"):
        return False
    return not (broker.before_enqueue_only_carries_traces() and (carried or tracing.nothing_to_carry()))


def before_enqueue(broker: StandmeetBroker, messages: Sequence[Message], delay_ms: int | None) -> None:
    """Refuse a message to an undeclared queue, then run the ``before_enqueue`` hooks of
    each message, as the policy says (:func:`runs_before_hooks`)."""
    for message in messages:
        if message.queue_name not in broker.queues:
            raise QueueNotFound(message.queue_name)
    if runs_before_hooks(broker):
        for message in messages:
            broker.emit_before("enqueue", message, delay_ms)


def after_enqueue(broker: StandmeetBroker, messages: Sequence[Message], delay_ms: int | None) -> None:
    """The ``after_enqueue`` hooks of each message written (none registered: no loop)."""
    if broker._hooks("after_enqueue"):
        for message in messages:
            broker.emit_after("enqueue", message, delay_ms)


# -- the statements ----------------------------------------------------------------------

#: How many times a send looks again for a key whose holder finished between its insert
#: and its look-up (each time, a holder finished and the key was free again).
UNIQUE_ATTEMPTS = 10


def unique_write(items: Sequence[UniqueItem], delay_s: float = 0.0) -> Generator[Step, list[Any], UniqueOutcome]:
    """The statements that write ``items``, one at a time (a generator: the sync and the
    async drivers, :func:`run_steps` and :func:`run_steps_async`, send each
    one's rows back). INSERT … ON CONFLICT DO NOTHING (:data:`broker.engine.sql_enqueue.ENQUEUE_UNIQUE`),
    then, in a new statement that sees what concurrent senders committed, the holder of
    each key not written (:data:`broker.engine.sql_enqueue.UNIQUE_LIVE`); a key whose holder finished in
    between is written again, at most UNIQUE_ATTEMPTS times."""
    live: list[str | None] = [None] * len(items)
    skipped: dict[tuple[str, str], int] = {}
    todo = list(range(len(items)))
    for _ in range(UNIQUE_ATTEMPTS):
        batch = [items[i] for i in todo]
        rows = yield sql_enqueue.ENQUEUE_UNIQUE, {
            **batch_params([it.text for it in batch], [it.priority for it in batch], delay_s=delay_s),
            **_unique_arrays(batch)}
        written = {row[0] for row in rows}
        rest = [i for i in todo if items[i].message_id not in written]
        if not rest:
            break
        looked = [items[i] for i in rest]
        rows = yield sql_enqueue.UNIQUE_LIVE, {"ids": [it.message_id for it in looked], **_unique_arrays(looked)}
        todo = []
        for n, live_id, live_text, own_exists in rows:
            i = rest[n - 1]
            if live_id == items[i].message_id:
                continue  # it holds its own key: sent again with its own id
            if live_id is not None:
                live[i] = live_text
                where = (items[i].queue_name, items[i].actor_name)
                skipped[where] = skipped.get(where, 0) + 1
            elif not own_exists:
                todo.append(i)  # its key's holder finished in between: the key is free
            # else: its id exists, finished: left as it was, as ENQUEUE leaves one
        if not todo:
            break
    else:
        raise DatabaseError(f"could not write {len(todo)} unique message(s): their keys' holders kept "
                            f"finishing between {UNIQUE_ATTEMPTS} inserts and look-ups")
    return UniqueOutcome(live, skipped)


def _unique_arrays(items: Sequence[UniqueItem]) -> dict[str, Any]:
    return {"unique_keys": [it.key.digest for it in items],
            "unique_periods": [it.key.period_s for it in items],
            "unique_states": [it.key.states for it in items]}


def run_steps(conn: psycopg.Connection[Any], steps: Generator[Step, list[Any], UniqueOutcome]) -> UniqueOutcome:
    """Run a unique write's statements on ``conn`` (in its transaction, if one is open)."""
    try:
        step = next(steps)
        while True:
            cur = conn.execute(*step)
            step = steps.send(cur.fetchall())
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


@dataclass
class PreparedBatch:
    """A batch checked and split by unique key (:func:`prepare_batch`); ``plain``: the
    messages without one, a checked :class:`broker.engine.copy_rows.CopyBatch` (or None)."""

    keyed: list[int]
    items: list[UniqueItem]
    plain: CopyBatch | None


def prepare_batch(broker: StandmeetBroker, messages: Sequence[Message]) -> PreparedBatch:
    """Check ``messages`` and split them by unique key; no statement, no connection."""
    keyed, keys = split_unique(messages, broker)
    limit = broker.settings.message_max_bytes
    items = [unique_item(messages[i], keys[i], max_bytes=limit) for i in keyed]  # type: ignore[arg-type]
    plain = [m for m, k in zip(messages, keys, strict=True) if k is None] if keyed else messages
    return PreparedBatch(keyed, items, CopyBatch(plain, max_bytes=limit) if plain else None)


def _write_batch(conn: psycopg.Connection[Any], broker: StandmeetBroker, messages: Sequence[Message],
                 delay_ms: int | None, prepared: PreparedBatch | None = None,
                 ) -> tuple[list[Message], dict[tuple[str, str], int]]:
    """Write ``messages`` on ``conn`` (in its transaction): the plain ones copied
    (:func:`write_plain`), those with a unique key in the statements of
    :func:`unique_write`; each skipped one is replaced by the live message of its key.
    Every message is checked before the first statement (``prepared``: already, by
    :func:`prepare_batch`). Returns them, and the skips to count."""
    delay_s = delay_seconds(delay_ms)
    if prepared is None:
        prepared = prepare_batch(broker, messages)
    keyed, items, plain_batch = prepared.keyed, prepared.items, prepared.plain
    written = list(messages)
    if not items:
        assert plain_batch is not None
        write_plain(conn, plain_batch, delay_ms)
        return written, {}
    with _all_or_nothing(conn):  # the plain rows and the keyed ones: all or none
        if plain_batch is not None:
            write_plain(conn, plain_batch, delay_ms)
        outcome = run_steps(conn, unique_write(items, delay_s))
    for i, live in zip(keyed, live_messages([as_message(messages[i]) for i in keyed], outcome), strict=True):
        written[i] = live
    return written, outcome.skipped


def write_plain(conn: psycopg.Connection[Any], batch: CopyBatch, delay_ms: int | None) -> None:
    """Write a batch of messages without a unique key on ``conn``, due after ``delay_ms``
    (already checked: :func:`broker.engine.codec.delay_seconds`), all or none
    (:func:`_all_or_nothing`), and wake their queues at commit: copied
    (``sql_enqueue.COPY_QUEUED``), a chunk of rows at a time; where an id exists already,
    rolled back and written again by ``sql_enqueue.ENQUEUE``, a chunk at a time (a queued
    message takes the new text, a started one is left as it is).

    A message the batch refuses as its chunk comes, or any Exception making a row, ends the
    copy there; what was copied is rolled back, then that error is raised as it was (the
    server is told nothing of it; a refusal stays one even where an id existed)."""
    delay_s = delay_seconds(delay_ms)
    if conn.pgconn.pipeline_status == psycopg.pq.PipelineStatus.OFF:  # COPY is not for a pipeline
        failure: Exception | None = None
        try:
            with _all_or_nothing(conn):
                end_of_row = "\n"
                if delay_s:
                    row = conn.execute(sql_enqueue.ETA_AFTER, {"delay_s": delay_s}).fetchone()
                    assert row is not None
                    end_of_row = f"\t{row[0]}\n"
                with conn.cursor().copy(sql_enqueue.COPY_QUEUED_AT if delay_s else sql_enqueue.COPY_QUEUED) as copy:
                    failure = _copy_rows(copy, batch.texts(end_of_row))
                if failure is not None:
                    raise _CopyAbandoned  # undoes the rows copied before it
                conn.execute(sql_enqueue.WAKE_QUEUES, {"queues": batch.queues})
            return
        except (psycopg.errors.UniqueViolation, _CopyAbandoned):  # an id exists, or a row failed: none written
            pass
        if failure is not None:
            raise failure  # outside the handlers: its own traceback and causes, nothing added
    with _all_or_nothing(conn):
        for start, end in batch.spans():
            conn.execute(sql_enqueue.ENQUEUE, enqueue_params(batch.messages[start:end], delay_ms,
                                                             max_bytes=batch.max_bytes))
        _answered(conn)  # in a pipeline: a refusal raises here, while its savepoint can undo it


def _copy_rows(copy: psycopg.Copy, texts: Iterator[str]) -> Exception | None:
    """Feed ``texts`` to ``copy``; the error making the next one raised (a refused message,
    an encoder's), which ends the rows there, or None. The copy's own errors are raised."""
    while True:
        try:
            text = next(texts)
        except StopIteration:
            return None
        except Exception as exc:
            return exc
        copy.write(text)


class _CopyAbandoned(Exception):
    """Rolls back a copy ended early because a row of its batch could not be made."""


@contextmanager
def _all_or_nothing(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """The statements of the block in one transaction of their own on an autocommit
    connection outside one (committed at the end of the block); else under a savepoint of
    the transaction (begun, on a connection that is not autocommit, as any statement
    begins one), rolled back to if the block raises: nothing is left of it, and the
    caller's transaction is usable."""
    _answered(conn)  # a pipeline's state is the server's once it has answered what came before
    if conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
        raise MessageRefused("the connection's transaction has failed already (a statement before this one "
                             "raised): roll it back first; nothing was written")
    if conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        with conn.transaction():
            yield
        return
    conn.execute(sql_enqueue.SAVEPOINT)
    try:
        yield
    except BaseException:
        if not conn.closed and conn.pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF:
            # A pipeline may raise a refusal as soon as it arrives, before the server's
            # answers to what followed it (the transaction's state then reads "active"):
            # take them all first, so that the savepoint below is rolled back to.
            try:
                _answered(conn)
            except psycopg.Error:
                pass  # the same refusal, or the statements it aborted
        if not conn.closed and conn.info.transaction_status in (psycopg.pq.TransactionStatus.INTRANS,
                                                                psycopg.pq.TransactionStatus.INERROR):
            try:
                conn.execute(sql_enqueue.ROLLBACK_TO_SAVEPOINT)
                conn.execute(sql_enqueue.RELEASE_SAVEPOINT)
                _answered(conn)
            except (psycopg.OperationalError, psycopg.InterfaceError):
                pass  # the connection went, and the transaction with it: the first error says why
        raise
    conn.execute(sql_enqueue.RELEASE_SAVEPOINT)


def _answered(conn: psycopg.Connection[Any]) -> None:
    """On a connection in pipeline mode, send what is queued and wait for the server's
    answers (raising a refusal now, not at the caller's next statement); else nothing."""
    if conn.pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF:
        with conn.pipeline() as pipeline:
            pipeline.sync()


# -- the broker's sends ------------------------------------------------------------------

def send(broker: StandmeetBroker, message: Message, *, delay_ms: int | None = None) -> Message:
    """``actor.send()``: write ``message`` (due after ``delay_ms``) on the broker's pool and
    wake its queue's consumers; the message written, or the live one of its unique key."""
    before_enqueue(broker, [message], delay_ms)
    key = unique_key_of(message, broker)
    try:
        if key is None:
            broker.execute(sql_enqueue.ENQUEUE_ONE, enqueue_one_params(
                message, delay_ms, max_bytes=broker.settings.message_max_bytes))
        else:  # written unless its key is live: then the live message is returned
            item = unique_item(message, key, max_bytes=broker.settings.message_max_bytes)
            with broker.pool.connection() as conn:
                outcome = run_steps(conn, unique_write([item], delay_seconds(delay_ms)))
            count_skips(outcome.skipped, broker)
            message = live_messages([as_message(message)], outcome)[0]
    except DISCONNECTS as exc:
        raise BrokerConnectionError(f"could not enqueue {message.message_id}: {exc}") from exc
    except psycopg.Error as exc:
        raise DatabaseError(f"could not enqueue {message.message_id}: Postgres answered {type(exc).__name__}: {first_line(exc)}") from exc
    after_enqueue(broker, [message], delay_ms)
    return message


def send_many(broker: StandmeetBroker, messages: Sequence[Message], *, conn: psycopg.Connection[Any] | None = None,
              delay_ms: int | None = None) -> list[Message]:
    """``broker.enqueue_many``: write many messages at once (on ``conn``, in its
    transaction, if given; else in one transaction on the broker's pool), a chunk at a
    time (:mod:`broker.engine.copy_rows`)."""
    batch = list(messages)
    if not batch:
        return batch
    for message in batch:
        message.options.pop("eta", None)
    before_enqueue(broker, batch, delay_ms)
    check_distinct_ids(batch)  # one row per id: refused before anything is written
    skipped: dict[tuple[str, str], int] = {}
    rows: CopyBatch | None = None
    try:
        if conn is not None:  # every message checked before the caller's first statement
            batch, skipped = _write_batch(conn, broker, batch, delay_ms)
        elif any_unique_key(batch, broker):  # every message checked before a connection is taken
            prepared = prepare_batch(broker, batch)
            with broker.pool.connection() as own, own.transaction():
                batch, skipped = _write_batch(own, broker, batch, delay_ms, prepared)
        else:  # the fast path: copied in one transaction of a pooled connection, each chunk
            # checked as its rows are made (a refusal rolls that transaction back whole)
            delay_seconds(delay_ms)  # refused before anything else
            rows = CopyBatch(batch, max_bytes=broker.settings.message_max_bytes, check_now=False)
            rows.check_first_chunk()  # a short batch is checked whole before a connection is taken
            with broker.pool.connection() as own:
                write_plain(own, rows, delay_ms)
    except DISCONNECTS as exc:
        _refusal_first(rows)  # a refused message is the error to see, whatever the database did
        raise BrokerConnectionError(f"could not enqueue {len(batch)} message(s): {exc}") from exc
    except psycopg.Error as exc:
        _refusal_first(rows)
        raise DatabaseError(f"could not enqueue {len(batch)} message(s): Postgres answered {type(exc).__name__}: {first_line(exc)}") from exc
    count_skips(skipped, broker)
    after_enqueue(broker, batch, delay_ms)
    return batch


def _refusal_first(rows: CopyBatch | None) -> None:
    """Raise the refusal of a message of ``rows`` not checked yet, if any, on its own."""
    if rows is not None:
        try:
            rows.check_all()
        except MessageRefused as refused:
            raise refused from None


def send_from_run(broker: StandmeetBroker, context: SettleContext, message: Message, delay_ms: int | None) -> Message:
    """A message sent from the after-hooks of a run on this thread: checked now (a bad
    message must not hold up the settle of others), written with that run's settle (in
    the same transaction, and only if the run is settled). The run's own message sent
    again (a retry, a snooze) is its settle's outcome: queued again after ``delay_ms``."""
    before_enqueue(broker, [message], delay_ms)
    if message.message_id == context.proxy.message_id:
        context.requeue_delay_ms = int(delay_seconds(delay_ms) * 1000)
    else:
        enqueue_one_params(message, delay_ms, max_bytes=broker.settings.message_max_bytes)
        context.followups.append((as_message(message), delay_seconds(delay_ms), unique_key_of(message, broker)))
    after_enqueue(broker, [message], delay_ms)
    return message


# -- the relay -----------------------------------------------------------------------------

def relay_hooks(broker: StandmeetBroker) -> tuple[bool, bool]:
    """For a relay pass: whether every message goes through the hooks (an ``after_enqueue``
    hook, or a ``before_enqueue`` one that is not carrier-only), and whether a message
    whose event carried no trace does (the policy: :func:`runs_before_hooks`)."""
    every = bool(broker._hooks("after_enqueue")) or runs_before_hooks(broker, carried=True)
    return every, every or runs_before_hooks(broker)


def relay_write(conn: psycopg.Connection[Any], broker: StandmeetBroker,
                pending: Sequence[tuple[str, str] | Message | UniqueItem]) -> dict[tuple[str, str], int]:
    """Write a relay pass's messages on ``conn`` (in its transaction), in event order: each
    a (JSON text, priority) built by the route, a ``Message`` that goes through the hooks
    (``before_enqueue`` runs here), or one with its unique key. Returns the sends skipped
    because their key was live, per (queue, actor) (a re-relayed one is its own)."""
    for message in pending:  # a Message is one the policy sends through the hooks (relay_hooks)
        if isinstance(message, Message):
            if message.queue_name not in broker.queues:
                raise QueueNotFound(message.queue_name)
            broker.emit_before("enqueue", message, None)
    texts: list[str] = []
    priorities: list[str] = []
    keyed: list[UniqueItem] = []
    for m in pending:
        if isinstance(m, UniqueItem):
            keyed.append(m)
        elif isinstance(m, Message):
            key: UniqueKey | None = unique_key_of(m, broker)
            if key is not None:
                keyed.append(UniqueItem(m.message_id, m.queue_name, m.actor_name, message_json(m),
                                        str(message_priority(m)), key))
            else:
                texts.append(message_json(m))
                priorities.append(str(message_priority(m)))
        else:
            texts.append(m[0])
            priorities.append(m[1])
    for start, end in codec.within_chars([len(text) for text in texts]):
        conn.execute(sql_enqueue.ENQUEUE, batch_params(texts[start:end], priorities[start:end]))
    skipped: dict[tuple[str, str], int] = {}
    for start, end in codec.within_chars([len(item.text) for item in keyed]):
        for where, n in run_steps(conn, unique_write(keyed[start:end])).skipped.items():
            skipped[where] = skipped.get(where, 0) + n
    return skipped


def relay_written(broker: StandmeetBroker, hooked: Sequence[Message], skipped: dict[tuple[str, str], int]) -> None:
    """A relay pass committed: the ``after_enqueue`` hooks of its hooked messages, and its skips counted."""
    after_enqueue(broker, hooked, None)
    count_skips(skipped, broker)


# -- the caller's transaction --------------------------------------------------------------

def build_message(actor: dramatiq.Actor | str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                  options: dict[str, Any] | None = None) -> Message:
    broker = current_broker()
    target = broker.get_actor(actor) if isinstance(actor, str) else actor
    return target.message_with_options(args=args, kwargs=kwargs or {}, **(options or {}))


@dataclass
class PreparedSend:
    """A send checked and through its ``before_enqueue`` hooks, ready to be written:
    ENQUEUE_ONE's parameters, or the unique item of a message with a unique key."""

    broker: StandmeetBroker
    message: Message
    delay_ms: int | None
    params: dict[str, Any] | None
    item: UniqueItem | None


def prepare_send(message: Message, *, delay_ms: int | None = None) -> PreparedSend:
    """Check ``message`` and run its ``before_enqueue`` hooks; nothing is written yet."""
    broker = current_broker()
    before_enqueue(broker, [message], delay_ms)
    limit = broker.settings.message_max_bytes
    key = unique_key_of(message, broker)
    if key is None:
        return PreparedSend(broker, message, delay_ms, enqueue_one_params(message, delay_ms, max_bytes=limit), None)
    return PreparedSend(broker, message, delay_ms, None, unique_item(message, key, max_bytes=limit))


def send_steps(prepared: PreparedSend) -> Generator[Step, list[Any], UniqueOutcome]:
    """The statements of a prepared send (one, unless its unique key is taken)."""
    if prepared.item is None:
        assert prepared.params is not None
        yield sql_enqueue.ENQUEUE_ONE, prepared.params
        return UniqueOutcome([None], {})
    return (yield from unique_write([prepared.item], delay_seconds(prepared.delay_ms)))


def finish_send(prepared: PreparedSend, outcome: UniqueOutcome) -> Message:
    """The message written, or the live one its key returned; ``after_enqueue`` hooks run."""
    message = live_messages([prepared.message], outcome)[0]
    after_enqueue(prepared.broker, [message], prepared.delay_ms)
    return message


def enqueue_message(conn: psycopg.Connection[Any], message: Message, *, delay_ms: int | None = None) -> Message:
    """Write ``message`` on ``conn`` (in its transaction, if one is open); the message
    written, or the live message of its unique key."""
    prepared = prepare_send(message, delay_ms=delay_ms)
    outcome = run_steps(conn, send_steps(prepared))
    count_skips(outcome.skipped, prepared.broker)
    return finish_send(prepared, outcome)


def enqueue_messages(conn: psycopg.Connection[Any], messages: list[Message]) -> list[Message]:
    """Write many messages on ``conn``, in its transaction (copied, those with a unique
    key in statements of their own: :func:`_write_batch`); each skipped one is replaced by
    the live message of its key."""
    if not messages:
        return messages
    broker = current_broker()
    before_enqueue(broker, messages, None)
    written, skipped = _write_batch(conn, broker, messages, None)
    count_skips(skipped, broker)
    after_enqueue(broker, written, None)
    return written


def enqueue(conn: psycopg.Connection[Any], actor: dramatiq.Actor | str, *args: Any,
            delay_ms: int | None = None, options: dict[str, Any] | None = None, **kwargs: Any) -> Message:
    """Enqueue ``actor(*args, **kwargs)`` in the caller's transaction; return the message
    (for a unique actor whose key is live: the live message, whose ``message_id``
    ``get_result`` waits on)."""
    return enqueue_message(conn, build_message(actor, args, kwargs, options), delay_ms=delay_ms)


async def run_steps_async(aconn: psycopg.AsyncConnection[Any],
                          steps: Generator[Step, list[Any], UniqueOutcome]) -> UniqueOutcome:
    """:func:`run_steps` on an ``AsyncConnection``."""
    try:
        step = next(steps)
        while True:
            cur = await aconn.execute(*step)
            step = steps.send(await cur.fetchall())
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def enqueue_message_async(aconn: psycopg.AsyncConnection[Any], message: Message, *,
                                delay_ms: int | None = None) -> Message:
    """:func:`enqueue_message` on an ``AsyncConnection``, in its transaction."""
    prepared = prepare_send(message, delay_ms=delay_ms)
    outcome = await run_steps_async(aconn, send_steps(prepared))
    if outcome.skipped:  # on the broker's own (sync) connection: not on the event loop
        await asyncio.to_thread(count_skips, outcome.skipped, prepared.broker)
    return finish_send(prepared, outcome)


async def enqueue_async(aconn: psycopg.AsyncConnection[Any], actor: dramatiq.Actor | str, *args: Any,
                        delay_ms: int | None = None, options: dict[str, Any] | None = None,
                        **kwargs: Any) -> Message:
    """:func:`enqueue` for async code: ``await enqueue_async(aconn, actor, *args)`` writes
    the message on a psycopg ``AsyncConnection``, in its transaction, with the same checks
    and hooks."""
    return await enqueue_message_async(aconn, build_message(actor, args, kwargs, options), delay_ms=delay_ms)


#: For a statement of the caller's that marks one queued message done as it records its work:
#: its CTE and receipt's SELECT (:data:`sql.FINISH_ONE_QUEUED`), :func:`finish_one_params`'s parameters.
FINISH_ONE_QUEUED, RECEIPT_OF_FINISHED = sql.FINISH_ONE_QUEUED, sql.RECEIPT_OF_FINISHED


def finish_one_params(message_id: str | None, queue_name: str, *,
                      rejected_for: str | None = None) -> dict[str, Any]:
    """The parameters of :data:`FINISH_ONE_QUEUED` for ``message_id`` (None: none) of ``queue_name``, done
    (rejected, with ``rejected_for`` its error). No hook runs: it writes no message, it ends one."""
    spec = app.queue_spec(queue_name)
    return {"finish": message_id, "finish_error": rejected_for, "finish_receipt": spec is not None and spec.awaited}
