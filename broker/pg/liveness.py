"""How a row of a process that proves it lives by a heartbeat (``standmeet.worker_processes``,
``standmeet.relays``) is judged gone: silent for longer than its rescue window.

Each such process records the window it was started with (``rescue_after_s``: its
``STANDMEET_RESCUE_AFTER_S``; a relay's at least twice its heartbeat's pace) and steps
down within it once it cannot prove it lives. A judge (crash rescue, ``status``, the
relays' route check, the embedded server's stop) takes the longer of its own window and
the row's: in a fleet started with different windows, no process is judged gone sooner
than it would step down. A row of an older release, which records none, is judged by the
judge's window alone.
"""

from __future__ import annotations


def rescue_window(alias: str, param: str) -> str:
    """SQL: the rescue window of the row ``alias`` as an interval, the judge's own window
    being the statement's parameter ``param`` (seconds). A missing row (``alias``
    outer-joined) takes the judge's."""
    return f"make_interval(secs => greatest(%({param})s::float8, coalesce({alias}.rescue_after_s, 0)))"
