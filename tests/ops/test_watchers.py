"""The watch's contract (qca_lowmem.ops.watchers): which modes count as watchers, the one channel
that reaches them (the dispatch-mode stack), and what running hidden tells them."""

import pytest
import torch

from helpers import RecordingMode
from qca_lowmem import _torch_private as torch_private
from qca_lowmem import qca_update
from qca_lowmem.ops import watchers

pytestmark = pytest.mark.usefixtures("one_thread")


class Watcher(watchers.WatchingDispatchMode):
    """Lists the ops it sees, the leaves it is told about and what ran unseen."""

    def __init__(self):
        super().__init__()
        self.seen, self.reads, self.unseen = [], [], []

    def read(self, tensor):
        self.reads.append(tensor)

    def ran_unseen(self, read, made):
        self.unseen.append((list(read), list(made)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_watching_modes_are_the_stack_when_every_mode_only_watches():
    assert watchers.watching_modes() == [] and watchers.eager_watchers() == []
    with Watcher() as outer, Watcher() as inner:
        assert watchers.watching_modes() == [outer, inner]
        with RecordingMode():
            assert watchers.watching_modes() is None
    with RecordingMode(), Watcher():
        assert watchers.watching_modes() is None and watchers.eager_watchers() is None
    assert watchers.watching_modes() == []


def test_note_read_reaches_every_active_watcher_through_the_stack_alone():
    """Entered at any time, under another mode, or where dispatch is off (a layer run hidden casts
    its weight there): a watcher is told; after it exits, it is not."""
    w = torch.ones(2, requires_grad=True)
    watchers.note_read(w)  # no watcher: nothing to tell
    with Watcher() as outer:
        with RecordingMode(), Watcher() as inner:
            watchers.note_read(w)
        with torch_private.dispatch_disabled():
            watchers.note_read(w)
    watchers.note_read(w)
    assert [id(t) for t in outer.reads] == [id(w), id(w)] and [id(t) for t in inner.reads] == [id(w)]


def test_run_hidden_tells_the_watchers_what_ran_unseen():
    psi = torch.randn(1, 2, 2, 1, dtype=torch.complex128)
    delta = torch.randn(1, 2, 2, 2, dtype=torch.float64, requires_grad=True)
    with Watcher() as watcher:
        out = qca_update(psi, delta, 0.1)
    assert watcher.seen == []
    [(read, made)] = watcher.unseen
    assert [id(t) for t in read] == [id(psi), id(delta)] and [id(t) for t in made] == [id(out)]
    other = RecordingMode()  # a mode that is not a watcher sees the op itself
    with other, Watcher() as watcher:
        qca_update(psi, delta, 0.1)
    assert "qca_lowmem.qca_update" in other.seen and watcher.unseen == []


def test_a_tensor_subclass_read_keeps_its_dispatch_and_runs_watched():
    class Tagged(torch.Tensor):
        pass

    x = torch.ones(3).as_subclass(Tagged)
    with Watcher() as watcher:
        watchers.run_hidden(lambda: x + 1, (x,), [watcher])
    assert watcher.unseen == [] and "aten.add" in watcher.seen


def test_the_contract_is_abstract():
    mode = watchers.WatchingDispatchMode()
    with pytest.raises(NotImplementedError):
        mode.read(torch.ones(1))
    with pytest.raises(NotImplementedError):
        mode.ran_unseen([], [])
