"""Fixtures of the library's tests."""

import pytest

from fixtures.replayed_graphs import ReplayedGraphs
from qca_lowmem.recompute import step_graph


@pytest.fixture
def replayed_graphs(monkeypatch):
    monkeypatch.setattr(step_graph, "_captures_on", lambda device: True)
    monkeypatch.setattr(step_graph, "_graphs", ReplayedGraphs)
    ReplayedGraphs.made = []
    monkeypatch.setattr(ReplayedGraphs, "ahead_runs", "queued")
    return ReplayedGraphs.made
