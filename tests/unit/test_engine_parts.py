"""The engine's parts are given what they need: the settler and the liveness never reach
the broker (not even through another module), and no module of the runtime is past the
size a reader takes in at once."""

from __future__ import annotations

from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "broker" / "engine"
#: The runtime's ceiling for one file.
MAX_LINES = 650


@pytest.mark.parametrize("part", ["broker.engine.settler", "broker.engine.liveness"])
def test_the_part_does_not_import_the_broker(part):
    graph = grimp.build_graph("broker", exclude_type_checking_imports=True)
    assert graph.chain_exists(importer="broker.engine.broker", imported=part)  # the broker builds it
    assert not graph.chain_exists(importer=part, imported="broker.engine.broker"), graph.find_shortest_chain(
        importer=part, imported="broker.engine.broker")


def test_no_module_of_the_runtime_is_over_the_ceiling():
    sizes = {str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
             for part in ("broker", "middleware", "periodic") for path in (ROOT / part).rglob("*.py")}
    assert "broker/engine/broker.py" in sizes
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
