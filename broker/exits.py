"""The exit statuses a process of the runtime ends with on purpose (imports nothing: the
CLI's ``--help`` and every entry point read them)."""

#: A process that refuses its configuration (a ``ConfigError``: a bad setting, the
#: connection budget, a module that cannot load; sysexits.h EX_CONFIG): starting it again
#: cannot help, so ``run`` stops instead of restarting it.
CONFIG_REFUSED_EXIT = 78
