"""Postgres plumbing: pools and connections, the embedded server, migrations, the
preflight check and the connection budget. Nothing here knows what a job is."""
