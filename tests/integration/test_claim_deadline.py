"""A claim's deadline is set when the client sends it, by the server's clock.

A pooler whose server connections are all busy holds a query (PgBouncer's
``query_wait_timeout``: two minutes by default). A client cut off meanwhile gives the
query up; the pooler does not know, and forwards it once a server connection frees,
maybe long after the consumer checked (twice) what its process holds. The claim must
then claim nothing. A TCP relay in front of the test server stands in for the pooler.
"""

from __future__ import annotations

import os
import select
import socket
import threading

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.integration.test_step_down import _state
from tests.support.db import query, wait_for
from tests.support.jobs import held_through_a_cut

#: The server's ReadyForQuery message, idle: the end of an answer, after its commit.
READY_FOR_QUERY = b"Z\x00\x00\x00\x05I"


class _Pipe:
    """One client's connection through the relay. Tests may own threads; this one pumps."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.port = client.getpeername()[1]
        self.hold = False  # keep what the client sends (a pooler waiting for a free server connection)
        self.held = bytearray()
        self.cut = False  # the client is cut off; the pooler keeps the server session and what it held
        self.release = False  # forward what was held to the server (a server connection freed)
        self.released = threading.Event()
        self.answer = bytearray()  # what the server sent once what was held was forwarded
        self.answered = threading.Event()  # ... to its end (ReadyForQuery: the claim committed)
        self.closed = False
        threading.Thread(target=self._run, name="relay-pipe", daemon=True).start()

    def _run(self) -> None:
        client: socket.socket | None = self.client
        while not self.closed:
            if self.cut and client is not None:
                client.shutdown(socket.SHUT_RDWR)
                client.close()
                client = None
            if self.release and not self.released.is_set():
                self.server.sendall(bytes(self.held))
                self.released.set()
            readable, _, _ = select.select([s for s in (client, self.server) if s is not None], [], [], 0.02)
            for sock in readable:
                data = sock.recv(65536)
                if not data:
                    self.closed = True
                    break
                if sock is self.server:
                    if self.released.is_set():
                        self.answer += data
                        if READY_FOR_QUERY in self.answer:
                            self.answered.set()
                    if client is not None:
                        client.sendall(data)
                elif self.hold:
                    self.held += data
                else:
                    self.server.sendall(data)
        for sock in (client, self.server):
            if sock is not None:
                sock.close()


class _Relay:
    """A TCP relay in front of the test server, standing in for a pooler."""

    def __init__(self, url: str) -> None:
        params = conninfo_to_dict(url)
        host, port = str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)
        self.target: tuple[int, object] = (
            (socket.AF_UNIX, f"{host}/.s.PGSQL.{port}") if host.startswith("/") else (socket.AF_INET, (host, port)))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = make_conninfo(url, host="127.0.0.1", port=str(self.listener.getsockname()[1]))
        self.pipes: list[_Pipe] = []
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.socket(self.target[0], socket.SOCK_STREAM)
            server.connect(self.target[1])
            self.pipes.append(_Pipe(client, server))

    def pipe_of(self, conn: psycopg.Connection) -> _Pipe:
        mine = socket.socket(fileno=os.dup(conn.fileno()))
        try:
            port = mine.getsockname()[1]
        finally:
            mine.close()
        return next(p for p in self.pipes if p.port == port)

    def close(self) -> None:
        self.listener.close()
        for pipe in self.pipes:
            pipe.closed = True


def test_a_claim_a_pooler_forwards_after_the_consumer_checked_again_claims_nothing(
    broker, database_url, start_worker, monkeypatch
):
    from broker.engine import consumer as consumer_module
    from broker.engine import sql
    from broker.pg.pool import DIRECT, UNPROBED, Topology

    # Given a worker whose claim connection goes through a pooler (its server sessions
    # cannot be ended: the consumer checks again once a claim's window has passed)
    relay = _Relay(database_url)
    connect = consumer_module.connect
    monkeypatch.setattr(consumer_module, "connect", lambda url, **kwargs: connect(relay.url, **kwargs))
    monkeypatch.setattr(broker, "topology", Topology(mode=DIRECT, prepare=True, listen_url=broker.url,
                                                      how=f"{UNPROBED}: the server did not answer the probe"))
    message = held_through_a_cut.message("pooled-late", 0.0)
    state = broker.queue_states["index"]
    try:
        worker = start_worker(queues=["index"], threads=4)
        consumer = worker.consumers["index"].consumer
        wait_for(lambda: consumer.conn is not None, timeout_s=10, what="the consumer to connect")
        first = relay.pipe_of(consumer.conn)
        # and a claim the pooler holds, waiting for a free server connection
        first.hold = True
        query(database_url, "SELECT pg_notify(%s, '')", (sql.ENQUEUE_CHANNEL.format(queue="index"),))
        wait_for(lambda: first.held, timeout_s=10, what="the claim to be sent")
        # When the client is cut off from the pooler (which keeps the query), the consumer
        # connects again and checks, and checks again after the window
        first.cut = True
        wait_for(lambda: state.recheck_at is not None, timeout_s=10, what="the check, with a recheck to come")
        wait_for(lambda: state.recheck_at is None, timeout_s=sql.CLAIM_WITHIN_S + 10, what="the recheck")
        # and only then a server connection frees, and the pooler sends the held claim
        # (the live consumer is kept from claiming the message that came meanwhile)
        with state.claim_lock:
            broker.enqueue(message)
            first.release = True
            assert first.released.wait(10)
            # Then the late claim runs and claims nothing: the message stays queued
            assert first.answered.wait(10), "the late claim was not answered"
            assert _state(database_url, message.message_id) == ("queued", 0)
        # and the live consumer runs it
        wait_for(lambda: (_state(database_url, message.message_id) or ("",))[0] == "done", timeout_s=10,
                 what="the message to run")
    finally:
        relay.close()
