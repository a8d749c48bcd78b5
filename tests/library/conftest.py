"""Fixtures of the library's tests."""

import pytest

from fixtures import replayed_graphs as stand_in


@pytest.fixture
def replayed_graphs():
    """StepGraph captures on ReplayedGraphs (fixtures/replayed_graphs.py): the graphs made."""
    with stand_in.installed() as made:
        yield made
