"""The exit statuses a process of the runtime ends with on purpose (imports nothing: the
CLI's ``--help`` and every entry point read them)."""

#: A process that refuses its configuration (a ``ConfigError``: a bad setting, the
#: connection budget, a module that cannot load; sysexits.h EX_CONFIG): starting it again
#: cannot help, so ``run`` stops instead of restarting it.
CONFIG_REFUSED_EXIT = 78

#: A deliberate second Ctrl-C, this long after the first signal or more, forces a process
#: (a worker, the scheduler, ``run``) to exit at once, with status 1. A second signal
#: sooner is the echo of the first (a group's Ctrl-C, then ``run``'s SIGTERM a few ms
#: later; systemd and ``timeout`` do the same) and changes nothing.
FORCE_AFTER_S = 1.0
