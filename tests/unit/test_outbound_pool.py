"""The outbound connection pool keeps only connections that can carry another request."""

from __future__ import annotations

import socket

import pytest

from actors.http1 import KEEPALIVE_S, Key, Pool, _Connection

KEY = Key("http", "127.0.0.1", 80, "127.0.0.1")


@pytest.fixture
def pairs():
    made: list[socket.socket] = []

    def pair() -> tuple[socket.socket, socket.socket]:
        ours, theirs = socket.socketpair()
        made.extend((ours, theirs))
        return ours, theirs

    yield pair
    for sock in made:
        sock.close()


def test_an_idle_connection_is_taken_back_most_recent_first(pairs):
    pool = Pool()
    first, second = _Connection(KEY, pairs()[0]), _Connection(KEY, pairs()[0])
    pool.give(first)
    pool.give(second)
    assert pool.take(KEY) is second and pool.take(KEY) is first and pool.take(KEY) is None


def test_a_connection_its_peer_closed_while_idle_is_dropped_not_taken(pairs):
    pool = Pool()
    ours, theirs = pairs()
    pool.give(_Connection(KEY, ours))
    theirs.close()
    assert pool.take(KEY) is None and pool.idle() == 0
    assert ours.fileno() == -1  # closed by the pool


def test_a_connection_with_bytes_no_request_asked_for_is_dropped(pairs):
    pool = Pool()
    ours, theirs = pairs()
    pool.give(_Connection(KEY, ours))
    theirs.sendall(b"HTTP/1.1 200 OK\r\n")
    assert pool.take(KEY) is None


def test_a_connection_idle_longer_than_the_keep_alive_is_dropped(pairs):
    pool = Pool()
    conn = _Connection(KEY, pairs()[0])
    pool.give(conn)
    conn.idle_since -= KEEPALIVE_S + 0.1
    assert pool.take(KEY) is None


def test_a_full_pool_closes_the_connection_idle_longest(pairs):
    pool = Pool(max_idle=2)
    keys = [Key("http", "127.0.0.1", port, "127.0.0.1") for port in (81, 82, 83)]
    conns = [_Connection(key, pairs()[0]) for key in keys]
    for conn in conns:
        pool.give(conn)
    assert pool.idle() == 2 and conns[0].sock.fileno() == -1
    assert pool.take(keys[0]) is None and pool.take(keys[2]) is conns[2]
