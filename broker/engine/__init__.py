"""The queue engine: the Dramatiq broker on ``dramatiq.queue`` and everything that moves a row.

``broker.py`` (the broker, its consumer, claims and settles), ``sql.py`` (every statement
that claims, settles, gives back and rescues a message), ``enqueue.py`` (writing message
rows), ``wakeups.py`` (LISTEN/NOTIFY), ``cancel_watch.py`` (operators' cancels reaching
running jobs) and ``maintenance.py`` (the runtime's own jobs: retention, rescue).
"""
