"""A StepGraph whose capture fails: the rollout goes on eagerly after one warning that tells the
whole story, an OOM while capturing included (the trainer keeps its policy). CUDA is
simulated on the CPU: the capture is replaced by one that fails like torch.cuda.graph does."""

import warnings

import pytest
import torch
from torch import nn

import qca_lowmem
from helpers import episode, initial_state, randomize_affine
from qca_lowmem.recompute import cuda_graphs, step_graph
from qca_lowmem.trainer import config as config_mod
from qca_lowmem.trainer import train as train_mod

pytestmark = pytest.mark.usefixtures("one_thread")


def conv_step():
    torch.manual_seed(2)
    net = randomize_affine(nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 4, 3, padding=1)))
    net = net.double()
    return list(net.parameters()), lambda psi: qca_lowmem.qca_update(psi, net(qca_lowmem.qca_pack(psi)), gamma=0.05,
                                                                       multiplicative=False)


def failing_capture(first_error, attempts):
    """A _Capture that fails as torch.cuda.graph does: the body's error, then the capture's end
    raising another one while it propagates (so the first is only the second's __context__)."""

    class FailingCapture:
        def __init__(self, step, state, params, autocast_state, key, *args, **kwargs):
            attempts.append(key)
            with cuda_graphs.capture_errors_explained():
                try:
                    raise first_error()
                finally:
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    return FailingCapture


@pytest.fixture
def simulated_cuda(monkeypatch):
    monkeypatch.setattr(step_graph, "_captures", lambda psi: True)
    attempts = []

    def install(first_error):
        monkeypatch.setattr(step_graph, "_Capture", failing_capture(first_error, attempts))
        return attempts

    return install


def grads_of(step_fn, params, psi0, **options):
    def loss(psi0, psi_T, history):
        return (psi_T.abs() ** 2 * torch.arange(psi_T.shape[-1], dtype=torch.float64)).sum()

    return [g.clone() for g in episode(step_fn, params, psi0, 6, loss, **options).grads]


@pytest.mark.parametrize("checkpoint,slots", [("step", None), ("revolve", 2)])
def test_failed_capture_warns_once_with_the_first_error_first_and_rolls_out_eagerly(simulated_cuda, checkpoint, slots):
    attempts = simulated_cuda(lambda: RuntimeError("cudnn: operation not permitted when stream is capturing"))
    params, step = conv_step()
    psi0 = initial_state()
    expected = grads_of(step, params, psi0, checkpoint=checkpoint, slots=slots)
    graph = qca_lowmem.StepGraph(step)
    with pytest.warns(qca_lowmem.CaptureFallbackWarning) as caught:
        grads = grads_of(graph, params, psi0, checkpoint=checkpoint, slots=slots)
    # pytest.warns records every warning in the block: the fallback's gc.collect() also runs the
    # finalizers of earlier tests' garbage (an unclosed file's ResourceWarning), so count ours only.
    fallbacks = fallback_warnings(caught)
    assert len(fallbacks) == 1
    text = str(fallbacks[0].message)
    first, later = text.index("operation not permitted"), text.index("previous error during capture")
    assert first < later and "rolling this configuration out eagerly" in text
    assert all(torch.equal(g, e) for g, e in zip(grads, expected))
    assert graph.capture is None and graph.captures_made == 0 and len(attempts) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the same configuration: no second warning, no second try
        grads = grads_of(graph, params, psi0, checkpoint=checkpoint, slots=slots)
    assert not fallback_warnings(caught)
    assert len(attempts) == 1 and all(torch.equal(g, e) for g, e in zip(grads, expected))


def fallback_warnings(caught):
    return [w for w in caught if issubclass(w.category, qca_lowmem.CaptureFallbackWarning)]


def test_oom_while_capturing_rolls_out_eagerly(simulated_cuda):
    """The eager steps need less than a capture (no pool of their own); lowering the policy, as an
    OOM guard would, does not change what the capture needs."""
    attempts = simulated_cuda(lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    params, step = conv_step()
    psi0 = initial_state()
    expected = grads_of(step, params, psi0)
    graph = qca_lowmem.StepGraph(step)
    with pytest.warns(qca_lowmem.CaptureFallbackWarning) as caught:
        grads = grads_of(graph, params, psi0)
    text = str(fallback_warnings(caught)[0].message)
    assert "out of memory while capturing" in text and "rolling this configuration out eagerly" in text
    assert text.index("Tried to allocate 2.00 GiB") < text.index("previous error")  # the first error first
    assert all(torch.equal(g, e) for g, e in zip(grads, expected)) and len(attempts) == 1 and graph.failed_keys


def test_the_trainer_keeps_its_policy_after_an_oom_during_capture(simulated_cuda, tmp_path):
    attempts = simulated_cuda(lambda: torch.OutOfMemoryError("CUDA out of memory"))
    config = config_mod.TrainConfig(grid=8, d_state=2, hidden=8, qca_steps=5, episodes=2, seed=3,
                                    out_dir=str(tmp_path / "run"), device="cpu", save_every=0)
    trainer = train_mod.Trainer(config, progress=False)
    trainer.step_fn = qca_lowmem.StepGraph(trainer.step_fn)
    with pytest.warns(qca_lowmem.CaptureFallbackWarning, match="out of memory while capturing"):
        records = trainer.fit()
    assert [r["policy"] for r in records] == ["checkpoint=step batch=1 fp32 channels_last"] * 2  # not lowered
    assert len(attempts) == 1 and all(r["loss"] == r["loss"] for r in records)


class FakeCudaCapture:
    """torch.cuda's stream context, CUDAGraph, default generator and the allocator's pool routing, recorded: enough
    to see what CudaGraphs.capture leaves behind when a capture fails, without a GPU."""

    def __init__(self, monkeypatch, end_error=None):
        self.current, self.events, self.end_error = "default", [], end_error
        fake = self

        class StreamContext:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                self.before, fake.current = fake.current, self.stream

            def __exit__(self, *exc):
                fake.current = self.before

        class Graph:
            def capture_begin(self, pool, capture_error_mode):
                fake.events.append(("begin", fake.current, capture_error_mode))

            def capture_end(self):
                fake.events.append(("end", fake.current))
                if fake.end_error:
                    raise RuntimeError(fake.end_error)

            def replay(self):
                fake.events.append("replay")

        monkeypatch.setattr(torch.cuda, "stream", StreamContext)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool",
                            lambda device, pool: fake.events.append(("pool released", device, pool)), raising=False)

        class Generator:
            def clone_state(self):
                return "a copy of the state, not capturing"

            def graphsafe_set_state(self, state):
                fake.events.append(("generator state", state))

        monkeypatch.setattr(torch.cuda, "default_generators", (Generator(),))
        self.graphs = object.__new__(cuda_graphs.CudaGraphs)
        self.graphs.device, self.graphs.side, self.graphs.pool = torch.device("cuda", 0), "side", (0, 7)


def test_a_capture_whose_body_fails_restores_the_stream_the_allocator_and_the_generator(monkeypatch):
    fake = FakeCudaCapture(monkeypatch, end_error="operation failed due to a previous error during capture")

    def body():
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="not permitted when stream is capturing") as raised:
        fake.graphs.capture(body)
    assert "previous error" not in str(raised.value)  # the body's error, not the end's
    assert fake.current == "default"
    assert fake.events == [("begin", "side", "thread_local"), ("end", "side"), ("pool released", 0, (0, 7)),
                           ("generator state", "a copy of the state, not capturing")]


def test_a_capture_whose_end_fails_restores_the_stream_the_allocator_and_the_generator(monkeypatch):
    fake = FakeCudaCapture(monkeypatch, end_error="invalidated capture")
    with pytest.raises(RuntimeError, match="invalidated capture"):
        fake.graphs.capture(lambda: "outputs")
    assert fake.current == "default"
    assert fake.events[-2:] == [("pool released", 0, (0, 7)), ("generator state", "a copy of the state, not capturing")]


def test_a_capture_that_succeeds_leaves_the_pool_to_torch(monkeypatch):
    fake = FakeCudaCapture(monkeypatch)
    outputs, replay = fake.graphs.capture(lambda: "outputs")
    replay()
    assert outputs == "outputs" and fake.current == "default"
    assert fake.events == [("begin", "side", "thread_local"), ("end", "side"), "replay"]
