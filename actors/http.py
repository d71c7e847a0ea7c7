"""The one HTTP client the actors share (httpx clients are thread-safe).

Building a client loads the CA bundle — tens of milliseconds of CPU under the GIL — so
actors never build one per call. Redirects are never followed: a redirect is an outcome
to record, and following one would bypass the request-forgery guard.
"""

from __future__ import annotations

import httpx

CLIENT = httpx.Client(follow_redirects=False)
