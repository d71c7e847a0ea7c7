"""The queue engine: the Dramatiq broker on ``dramatiq.queue`` and everything that moves a row.

Where things are:

* ``broker.py``: :class:`StandmeetBroker`, the Dramatiq broker (queues, signals, the
  settle hand-off, shutdown); it builds the parts below and wires them together.
* ``consumer.py``: the consumer that claims a queue's messages, and the proxies it hands out.
* ``queues.py``: what this process holds of each queue (its claims, running or prefetched).
* ``settler.py``: how a run ended (``Outcome``), and the one writer of outcomes.
* ``liveness.py``: heartbeat, stepping down and up, crash rescue.
* ``enqueue.py``: the one writer of message rows, and its enqueue-hook policy
  (``enqueue``, ``enqueue_message(s)``, ``build_message``, ``FINISH_ONE_QUEUED``; the broker's
  sends, the relay's messages).
* ``codec.py``: a message's JSON text and priority, and the checks before it is written.
* ``unique.py``: unique-job keys (``UniqueBy``); no database code, as ``codec.py``: the
  memory broker (``broker.memory``) uses both.
* ``sql.py`` (claims, settles, give-backs, liveness, rescue; the channel names),
  ``sql_enqueue.py`` (the statements that insert messages), ``sql_history.py``
  (attempts and per-minute history).
* ``wakeups.py`` (LISTEN/NOTIFY), ``cancel_watch.py`` (operators' cancels reaching running
  jobs).

The engine knows neither the outbox nor the operators' parts (``lint-imports``); the
runtime's own jobs (retention, rescue, pruning the outbox) are ``broker.maintenance``.
"""
