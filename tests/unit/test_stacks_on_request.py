"""Asking for the threads' stacks is registered only where stderr is a file the
interpreter can write to; elsewhere (a buffer, None) the command runs all the same."""

from __future__ import annotations

import io
import sys

import pytest

from broker.observability.stacks import dump_stacks_on_request


@pytest.mark.parametrize("stderr", [io.StringIO(), None], ids=["a buffer", "none"])
def test_a_stderr_that_is_no_file_registers_nothing_and_raises_nothing(monkeypatch, stderr):
    monkeypatch.setattr(sys, "stderr", stderr)
    assert dump_stacks_on_request() is False
