"""`standmeet-jobs migrate` prepares an empty database, idempotently, from several processes at once."""

from __future__ import annotations

import subprocess
import sys

from tests.support import db as testdb
from tests.support.procs import ROOT


def test_three_concurrent_migrations_of_an_empty_database_apply_each_version_once(admin_url, subprocess_env):
    name = testdb.unique_name("smt_empty")
    testdb.drop_database(admin_url, name)
    testdb.query(admin_url, f'CREATE DATABASE "{name}"')
    url = testdb.with_dbname(admin_url, name)
    try:
        env = {**subprocess_env, "DATABASE_URL": url}
        cmd = [sys.executable, "-m", "broker.cli", "migrate"]
        procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(3)]
        results = [(p.wait(timeout=60), *p.communicate()) for p in procs]
        assert [r[0] for r in results] == [0, 0, 0], results
        # one process applied everything; the others found it done
        outputs = [r[1] for r in results]
        assert outputs.count("schema up to date\n") == 2, outputs
        assert sum(o.startswith("applied 0001_dramatiq_queue") for o in outputs) == 1, outputs
        from broker.pg.migrate import available_migrations

        versions = [r[0] for r in testdb.query(url, "SELECT version FROM standmeet.schema_migrations ORDER BY version")]
        assert versions == [m.version for m in available_migrations()]
        assert testdb.scalar(url, "SELECT to_regclass('dramatiq.queue') IS NOT NULL")
        again = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and again.stdout == "schema up to date\n"
    finally:
        testdb.drop_database(admin_url, name)
