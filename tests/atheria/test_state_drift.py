"""State that the steps' unfollowed code keeps outside its tensors, moved by the recomputes: an
engine whose step counts its calls (on itself, a module, a class, a dict or a default argument of
theirs, a function's attribute, a dataclass with slots, callbacks in a list, in a numpy array, a
deque or a list in a dict, or through a functools.partial) or reads a schedule from an iterator, a
wrapper set on the engine's step that logs them, a noise injector that logs its rates or draws
from a generator of its own, forward hooks recording activations or counting calls. Stock's
episode runs each step once; a recomputing one runs them again, so such state would leave the
episode elsewhere than stock's, silently. Each is refused, naming the state, where the episode
recomputes, and trains as stock does (float64, the same bits' worth) under checkpoint='none'. A
tensor bound anew at each call (a running total, the last state kept for a plot in an object, a
dict, a tuple, an object in a list, a global, a cell or a module of theirs), or any value bound in
a global the step never reads, is bound to the forward's again, as stock leaves it, unless a
backward hook on its holder may have bound it (refused), or it retains its gradient (refused);
one the backward binds (a custom Function's backward, a hook on a tensor) is left as it bound it.
Followed code is not read."""

import collections
import dataclasses
import functools
import threading
from types import SimpleNamespace

import numpy
import pytest
import torch

import qca_lowmem
from fixtures import researcher_config
from fixtures.switch_variants import GradientProbe
from qca_lowmem import recomputing, stock
from qca_lowmem.atheria.engine_step import engine_code
from qca_lowmem.atheria.mask_free_noise import injector_code
from qca_lowmem.examples.qc_trainer_v4 import QC_Trainer_v4, make_config

pytestmark = pytest.mark.usefixtures("one_thread")

EPISODES = (2000, 2001)  # the noise curriculum's full rate: noise every step


def make_trainer():
    torch.manual_seed(0)
    cfg = make_config(grid=8, d_state=2, hidden=4, qca_steps=4, gamma=0.05, dtype=torch.complex128)
    trainer = QC_Trainer_v4(cfg, state_object=True, max_noise=0.3, operator=stock.UNetUnitary(2, 4).double())
    with torch.no_grad():
        trainer.motor.operator.outc.weight.normal_(0.0, 0.1)
    return trainer


def stepping_engine(name: str, before_step, state=None, read=None):
    """An edit giving the engine a class of its own, `name`, whose step runs before_step(engine),
    then the engine's step, its output unchanged. `state(engine)` is set on the engine first as
    `state_kept`; every count starts at 0. The edit returns how to read what before_step moved:
    `read(state_kept)`, else the counts kept elsewhere (a module, a class, a dict, a default)."""
    def edit(trainer):
        base = type(trainer.motor)

        def evolve_step(self, psi):
            before_step(self)
            return base.evolve_step(self, psi)

        trainer.motor.__class__ = type(name, (base,), {"evolve_step": evolve_step})
        if state is not None:
            trainer.motor.state_kept = state(trainer.motor)
        researcher_config.CALLS, CallStats.calls, STATS.counts["calls"], _on_a_function.calls = 0, 0, 0, 0
        _in_a_default.__defaults__[0][0] = 0
        if read is not None:
            return lambda t: read(t.motor.state_kept)
        return lambda t: (researcher_config.CALLS, CallStats.calls, STATS.counts["calls"],
                          _in_a_default.__defaults__[0][0], getattr(t.motor, "calls", 0))
    return edit


class CallStats:
    """A class of the researcher's counting calls in a class attribute (read as a global)."""

    calls = 0


STATS = SimpleNamespace(counts={"calls": 0})  # an object of the researcher's, holding a dict


def _on_itself(engine):
    engine.calls = getattr(engine, "calls", 0) + 1


def _on_its_class(engine):  # without super(), no cell of the function holds the class
    type(engine).calls = getattr(type(engine), "calls", 0) + 1


def _on_config(engine):
    researcher_config.CALLS += 1


def _on_class(engine):
    CallStats.calls += 1


def _in_a_dict(engine):
    STATS.counts["calls"] += 1


def _in_a_default(engine, _calls=[0]):  # a mutable default, Python's own memo
    _calls[0] += 1


def _next(engine):
    next(engine.state_kept)


def _through_a_partial(engine):
    engine.state_kept()


def _count(calls):
    calls[0] += 1


def _in_a_numpy_array(engine):
    engine.state_kept[0] += 1


def _appended(engine):
    engine.state_kept.append(None)


def _in_a_list_in_a_dict(engine):
    engine.state_kept["calls"].append(None)


def _in_an_object_it_holds(engine):
    engine.state_kept.counts[0] += 1


def _on_a_function(engine):  # a function's own attribute, a memo Python allows
    _on_a_function.calls += 1


_on_a_function.calls = 0


@dataclasses.dataclass(slots=True)
class SlottedStats:
    """A researcher's counters in a dataclass with slots (no __dict__)."""

    calls: int = 0


def _on_a_slot(engine):
    engine.state_kept.calls += 1


class Callback:
    """A researcher's callback, kept in a list the engine holds."""

    def __init__(self):
        self.calls = 0

    def on_step(self):
        self.calls += 1


def _in_callbacks(engine):
    for callback in engine.state_kept:
        callback.on_step()


def _left(iterator):
    return len(list(iterator))


STEP_STATE_EDITS = {
    "engine counting its calls": (stepping_engine("Counting", _on_itself), r"Counting\.calls"),
    "an engine counting its calls on its own class": (stepping_engine("OwnClassCounting", _on_its_class),
                                                      r"test_state_drift\.OwnClassCounting\.calls"),
    "an engine counting its calls on their config module": (stepping_engine("ConfigCounting", _on_config),
                                                            r"fixtures\.researcher_config\.CALLS"),
    "an engine counting its calls on a class of theirs": (stepping_engine("ClassCounting", _on_class),
                                                          r"test_state_drift\.CallStats\.calls"),
    "an engine counting its calls in a dict of an object of theirs": (stepping_engine("DictCounting", _in_a_dict),
                                                                      r"test_state_drift\.STATS\.counts"),
    "an engine counting its calls in a default argument": (stepping_engine("DefaultCounting", _in_a_default),
                                                           r"_in_a_default's default _calls"),
    "an engine reading a schedule from a list's iterator": (
        stepping_engine("Scheduled", _next, lambda engine: iter([1.0] * 100), _left), r"Scheduled\.state_kept"),
    "an engine reading a schedule from a generator": (
        stepping_engine("Scheduled", _next, lambda engine: (1.0 for _ in range(100)), _left),
        r"Scheduled\.state_kept"),
    "an engine counting its calls through a functools.partial": (
        stepping_engine("PartialCounting", _through_a_partial, lambda engine: functools.partial(_count, calls=[0]),
                        lambda kept: kept.keywords["calls"]), r"PartialCounting\.state_kept's argument calls"),
    "an engine counting its calls in a numpy array": (
        stepping_engine("HeldCounting", _in_a_numpy_array, lambda engine: numpy.zeros(2), numpy.ndarray.tolist),
        r"HeldCounting\.state_kept"),
    "an engine logging its calls in a deque": (
        stepping_engine("HeldCounting", _appended, lambda engine: collections.deque(maxlen=100), len),
        r"HeldCounting\.state_kept"),
    "an engine logging its calls in a list in a dict": (
        stepping_engine("NestedLog", _in_a_list_in_a_dict, lambda engine: collections.defaultdict(list),
                        lambda kept: len(kept["calls"])), r"NestedLog\.state_kept\['calls'\]"),
    "an engine counting its calls on a function's attribute": (
        stepping_engine("FunctionCounting", _on_a_function, lambda engine: _on_a_function,
                        lambda kept: kept.calls), r"FunctionCounting\.state_kept\.calls"),
    "an engine counting its calls in a dataclass with slots": (
        stepping_engine("SlotCounting", _on_a_slot, lambda engine: SlottedStats(), lambda kept: kept.calls),
        r"SlotCounting\.state_kept\.calls"),
    "an engine's callbacks in a list counting its calls": (
        stepping_engine("CallingBack", _in_callbacks, lambda engine: [Callback(), Callback()],
                        lambda kept: [callback.calls for callback in kept]),
        r"CallingBack\.state_kept\[0\]\.calls"),
    "an engine counting its calls in a numpy array of an object it holds": (
        stepping_engine("NestedNumpy", _in_an_object_it_holds, lambda engine: SimpleNamespace(counts=numpy.zeros(1)),
                        lambda kept: kept.counts.tolist()), r"NestedNumpy\.state_kept\.counts"),
}


def logged_step(trainer, own=None):
    """A wrapper set on the engine's step logging its calls, around `own` (by default the engine's
    step between episodes: its own, the fused one being there only while an episode runs)."""
    own, log = own or trainer.motor.evolve_step, []

    def evolve_step(psi):
        log.append(None)
        return own(psi)

    trainer.motor.evolve_step = evolve_step
    return lambda t: len(log)


class LoggingInjector(stock.NoiseInjector):
    def __init__(self):
        super().__init__()
        self.rates = []

    def apply_phase_flip(self, psi, rate=0.01):
        self.rates.append(rate)
        return super().apply_phase_flip(psi, rate)


class OwnGeneratorInjector(stock.NoiseInjector):
    """Draws from a generator of its own a value it does not use: psi unchanged, the generator moved."""

    def __init__(self):
        super().__init__()
        self.draw = torch.Generator().manual_seed(7)

    def apply_phase_flip(self, psi, rate=0.01):
        torch.rand(1, generator=self.draw)
        return super().apply_phase_flip(psi, rate)


def injector(cls):
    def edit(trainer):
        trainer.noise_injector = cls()
        return lambda t: t.noise_injector.rates if cls is LoggingInjector else t.noise_injector.draw.get_state()
    return edit


class ActivationRecorder:
    """A forward hook's object keeping the norms of what the operator returned."""

    def __init__(self):
        self.norms = []

    def hook(self, module, args, output):
        self.norms.append(float(output.detach().norm()))


def recorder_hook(trainer):
    recorder = ActivationRecorder()
    trainer.motor.operator.register_forward_hook(recorder.hook)
    return lambda t: recorder.norms


def lambda_recorder_hook(trainer):
    """The recorder called from a closure: its list is read through the closure's cell."""
    recorder = ActivationRecorder()
    trainer.motor.operator.register_forward_hook(lambda module, args, output: recorder.hook(module, args, output))
    return lambda t: recorder.norms


def counting_pre_hook(trainer):
    calls = []
    trainer.motor.operator.inc.register_forward_pre_hook(lambda module, args: calls.append(None))
    return lambda t: len(calls)


EDITS = {**STEP_STATE_EDITS,
         "a wrapper logging the engine's steps": (logged_step, r"logged_step\.<locals>\.evolve_step's log"),
         "an injector logging its rates": (injector(LoggingInjector), r"QC_Trainer_v4\.noise_injector\.rates"),
         "an injector drawing from its own generator": (injector(OwnGeneratorInjector),
                                                        r"QC_Trainer_v4\.noise_injector\.draw"),
         "a forward hook's object recording activations": (recorder_hook, r"the hook ActivationRecorder\.hook's "
                                                                           r"ActivationRecorder\.norms"),
         "a closure's recorder": (lambda_recorder_hook, r"lambda_recorder_hook\.<locals>\.<lambda>'s recorder"),
         "a forward-pre hook counting calls in a closure": (counting_pre_hook, r"counting_pre_hook\.<locals>\."
                                                                              r"<lambda>'s calls")}


def run(edit, enable=None):
    """The edit made (after enable() where it is given), two episodes; (losses, weights, the state read)."""
    trainer = make_trainer()
    if enable is not None:
        qca_lowmem.enable(trainer, **enable)
    read = edit(trainer)
    torch.manual_seed(5)
    numpy.random.seed(5)  # the bit flips' coin
    losses = [trainer.train_episode(e)[0] for e in EPISODES]
    return losses, [p.detach().clone() for p in trainer.motor.operator.parameters()], read(trainer)


@pytest.mark.parametrize("name", EDITS)
@pytest.mark.parametrize("policy", [dict(checkpoint="step"), dict(checkpoint="revolve", slots=2),
                                    dict(checkpoint="auto", budget=2**14)])
def test_state_the_recomputes_move_refuses_the_episode_naming_it(name, policy):
    edit, named = EDITS[name]
    trainer = make_trainer()
    qca_lowmem.enable(trainer, **policy)
    edit(trainer)
    torch.manual_seed(5)
    with pytest.raises(RuntimeError, match=f"qca_lowmem: {named}.* changed during the backward"):
        trainer.train_episode(EPISODES[0])


@pytest.mark.parametrize("name", EDITS)
def test_without_recomputes_the_edited_code_trains_as_stock(name):
    edit, _ = EDITS[name]
    expected, got = run(edit), run(edit, dict(checkpoint="none"))
    assert got[0] == pytest.approx(expected[0], rel=1e-12, abs=0)
    for w, s in zip(got[1], expected[1], strict=True):
        assert torch.allclose(w, s, rtol=1e-11, atol=1e-15)
    state, stock_state = got[2], expected[2]
    if isinstance(state, torch.Tensor):
        assert torch.equal(state, stock_state)
    else:  # a count, or the norms the fused blocks compute to rounding
        assert state == pytest.approx(stock_state, rel=1e-12, abs=0)


def totalling_engine(trainer):
    """The engine's class with a step binding a new running total of |psi| at each call."""
    base = type(trainer.motor)

    class Totalling(base):
        def evolve_step(self, psi):
            self.total = getattr(self, "total", 0) + psi.detach().abs().sum()
            return super().evolve_step(psi)

    trainer.motor.__class__ = Totalling
    return lambda t: t.motor.total


class TotallingInjector(stock.NoiseInjector):
    def __init__(self):
        super().__init__()
        self.total = torch.zeros((), dtype=torch.float64)

    def apply_phase_flip(self, psi, rate=0.01):
        self.total = self.total + psi.detach().abs().sum()
        return super().apply_phase_flip(psi, rate)


def totalling_injector(trainer):
    trainer.noise_injector = TotallingInjector()
    return lambda t: t.noise_injector.total


SHOWN = None  # the last state the plotting engine's step kept in a global ("global")
SHOWN_NORM = None  # its norm, a float ("a number in a global")


def plotting_engine(kept_in: str):
    """The engine's class with a step keeping its last output for a plot: in an object it holds
    (or one in a list), in a dict, as a pair (a tuple) on itself, in a global or a closure's cell
    its step binds without reading (or its norm, a number, in such a global), or on a module of theirs."""
    def edit(trainer):
        base = type(trainer.motor)
        shown = None

        class Plotting(base):
            def evolve_step(self, psi):
                global SHOWN, SHOWN_NORM  # noqa: PLW0603  (a researcher's globals, bound, never read, by the step)
                nonlocal shown
                out = super().evolve_step(psi)
                if kept_in == "pair":
                    self.pair = (psi.detach(), out.detach())
                elif kept_in == "listed":
                    self.plot[0].last = out.detach()
                elif kept_in == "dict":
                    self.plot["last"] = out.detach()
                elif kept_in == "global":
                    SHOWN = out.detach()
                elif kept_in == "a number in a global":
                    SHOWN_NORM = float(out.detach().norm())
                elif kept_in == "cell":
                    shown = out.detach()
                elif kept_in == "their module":
                    researcher_config.LAST_STATE = out.detach()
                else:
                    self.plot.last = out.detach()
                return out

        trainer.motor.__class__ = Plotting
        trainer.motor.plot = {"dict": {}, "listed": [SimpleNamespace()]}.get(kept_in, SimpleNamespace())
        return lambda t: {"pair": lambda: t.motor.pair[1], "dict": lambda: t.motor.plot["last"],
                          "listed": lambda: t.motor.plot[0].last, "object": lambda: t.motor.plot.last,
                          "global": lambda: SHOWN, "cell": lambda: shown,
                          "a number in a global": lambda: torch.tensor(SHOWN_NORM),
                          "their module": lambda: researcher_config.LAST_STATE}[kept_in]()
    return edit


PLOTTED = ["object", "dict", "pair", "listed", "global", "a number in a global", "cell", "their module"]


@pytest.mark.parametrize("edit", [totalling_engine, totalling_injector, *map(plotting_engine, PLOTTED)],
                         ids=["engine", "injector", *PLOTTED])
@pytest.mark.parametrize("policy", [dict(checkpoint="step"), dict(checkpoint="revolve", slots=2)])
def test_a_tensor_the_recomputes_bind_anew_ends_as_the_forward_left_it(edit, policy):
    """A new tensor bound at each call, on the engine or the injector, in an object or a dict the
    engine holds, or in a tuple: the recomputes bind later ones (the last, step 0's); the episode
    binds the forward's again, so the total or the last state is stock's, and trains as stock."""
    expected, got = run(edit), run(edit, policy)
    assert got[0] == pytest.approx(expected[0], rel=1e-12, abs=0)
    for w, s in zip(got[1], expected[1], strict=True):
        assert torch.allclose(w, s, rtol=1e-11, atol=1e-15)
    assert torch.allclose(got[2], expected[2], rtol=1e-12, atol=0)  # the fused blocks' rounding


def probed_engine(by: str):
    """The engine's class with a step whose backward keeps the gradient of its output: through a
    custom Function on an object the engine holds ("function") or on the engine itself
    ("function on the engine"), or through a hook on its output tensor ("tensor hook")."""
    def edit(trainer):
        base = type(trainer.motor)

        class Probed(base):
            def evolve_step(self, psi):
                out = super().evolve_step(psi)
                if by == "tensor hook":
                    if out.requires_grad:
                        out.register_hook(lambda grad: setattr(self.probe, "last_grad", grad.detach().clone()))
                    return out
                store = self if by == "function on the engine" else self.probe
                return GradientProbe.apply(out, lambda grad: setattr(store, "last_grad", grad))

        trainer.motor.__class__ = Probed
        trainer.motor.probe = SimpleNamespace(last_grad=torch.zeros(()))
        trainer.motor.last_grad = torch.zeros(())
        return lambda t: t.motor.last_grad if by == "function on the engine" else t.motor.probe.last_grad
    return edit


@pytest.mark.parametrize("by", ["function", "function on the engine", "tensor hook"])
@pytest.mark.parametrize("policy", [dict(checkpoint="step"), dict(checkpoint="revolve", slots=2),
                                    dict(checkpoint="auto", budget=2**14)])
def test_a_tensor_the_backward_binds_is_left_as_the_backward_bound_it(by, policy):
    """The backward binds it as stock's does (the gradient of step 0's output last), after the
    recomputes: it is not bound again to the forward's (the one from the episode before)."""
    expected, got = run(probed_engine(by)), run(probed_engine(by), policy)
    assert got[0] == pytest.approx(expected[0], rel=1e-12, abs=0)
    assert got[2].shape == (1, 8, 8, 2) and torch.allclose(got[2], expected[2], rtol=1e-12, atol=0)


def retaining_engine(trainer):
    """The engine's class with a step keeping its output and its gradient (retain_grad, guarded)."""
    base = type(trainer.motor)

    class Retaining(base):
        def evolve_step(self, psi):
            out = super().evolve_step(psi)
            self.last_out = out
            if out.requires_grad:
                out.retain_grad()
            return out

    trainer.motor.__class__ = Retaining
    return lambda t: t.motor.last_out.grad


@pytest.mark.parametrize("policy", [dict(checkpoint="step"), dict(checkpoint="revolve", slots=2)])
def test_a_kept_tensor_retaining_its_gradient_is_refused_naming_it(policy):
    """The tensor a recompute bound retains the recompute's gradient; the forward's, which stock's
    episode leaves there, has none (it had been put back, its .grad None where stock's has the last
    step's). Refused, naming the fix; checkpoint='none' keeps stock's gradient."""
    trainer = make_trainer()
    qca_lowmem.enable(trainer, **policy)
    retaining_engine(trainer)
    torch.manual_seed(5)
    with pytest.raises(RuntimeError, match=r"Retaining\.last_out holds a tensor the step called retain_grad\(\) on.*"
                                           r"out\.register_hook"):
        trainer.train_episode(EPISODES[0])
    expected, got = run(retaining_engine), run(retaining_engine, dict(checkpoint="none"))
    assert got[2] is not None and torch.allclose(got[2], expected[2], rtol=1e-12, atol=0)


def guarded_recorder_hook(trainer):
    """The recorder, skipping the recomputes' calls as the refusal advises."""
    recorder = ActivationRecorder()
    trainer.motor.operator.register_forward_hook(
        lambda module, args, output: None if qca_lowmem.recomputing() else recorder.hook(module, args, output))
    return lambda t: recorder.norms


def imported_guard_recorder_hook(trainer):
    """The recorder skipping the recomputes through `from qca_lowmem import recomputing`: its code
    (a thread's depth of recomputing backwards, set at the first) is qca_lowmem's, not state of theirs."""
    recorder = ActivationRecorder()
    trainer.motor.operator.register_forward_hook(
        lambda module, args, output: None if recomputing() else recorder.hook(module, args, output))
    return lambda t: recorder.norms


def in_a_new_thread(function):
    """function() on a thread of its own (its first recomputing backward), its result or its exception."""
    result = {}

    def call():
        try:
            result["value"] = function()
        except Exception as error:  # pylint: disable=broad-except
            result["error"] = error

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.mark.parametrize("hook", [guarded_recorder_hook, imported_guard_recorder_hook])
@pytest.mark.parametrize("policy", [dict(checkpoint="step"), dict(checkpoint="revolve", slots=2)])
def test_a_hook_that_skips_the_recomputes_keeps_stocks_record(policy, hook):
    expected, got = run(hook), in_a_new_thread(lambda: run(hook, policy))
    assert got[0] == pytest.approx(expected[0], rel=1e-12, abs=0)
    assert len(got[2]) == 2 * 4 and got[2] == pytest.approx(expected[2], rel=1e-12, abs=0)


class Monitor:
    """A researcher's monitor: activation norms from a forward hook (skipping the recomputes, as
    the refusal advises) and gradient norms from a backward hook, on one object or on two."""

    def __init__(self):
        self.activations, self.gradients = [], []

    def forward_hook(self, module, args, output):
        if not qca_lowmem.recomputing():
            self.activations.append(float(output.detach().norm()))

    def backward_hook(self, module, grad_input, grad_output):
        self.gradients.append(float(grad_output[0].norm()))

    def parameter_hook(self, grad):
        self.gradients.append(float(grad.norm()))

    def last_gradient_hook(self, module, grad_input, grad_output):
        self.last_gradient = grad_output[0].detach().norm()


def monitored(split: bool, backward: str):
    """The monitor's forward hook on the operator's output conv, its backward hook there (`backward`
    "module", or "last" keeping the last gradient's norm as a tensor) or on that conv's weight
    ("parameter"), on the same Monitor unless `split`."""

    def edit(trainer):
        forward = Monitor()
        backward_monitor = Monitor() if split else forward
        conv = trainer.motor.operator.outc
        conv.register_forward_hook(forward.forward_hook)
        if backward == "module":
            conv.register_full_backward_hook(backward_monitor.backward_hook)
        elif backward == "last":
            backward_monitor.last_gradient = torch.zeros((), dtype=torch.float64)
            conv.register_full_backward_hook(backward_monitor.last_gradient_hook)
        else:
            conv.weight.register_hook(backward_monitor.parameter_hook)
        return lambda t: (forward.activations, backward_monitor.gradients or [float(backward_monitor.last_gradient)])

    return edit


@pytest.mark.parametrize("backward", ["module", "parameter", "last"])
@pytest.mark.parametrize("policy", [dict(checkpoint="step"), dict(checkpoint="revolve", slots=2)])
def test_one_object_as_forward_and_backward_hook_is_refused_as_such(policy, backward):
    """The backward hook writes the monitor (a list it appends to, a tensor it binds) before the
    recomputes call its forward hook: stock's backward writes it too, but the recomputes might
    read it (or bind it: one of the forward's is not put back); the refusal says so and what to do."""
    trainer = make_trainer()
    qca_lowmem.enable(trainer, **policy)
    monitored(split=False, backward=backward)(trainer)
    torch.manual_seed(5)
    moved = r"Monitor\.last_gradient \(or a tensor it holds\) was bound anew" if backward == "last" \
        else r"Monitor\.gradients changed"
    with pytest.raises(RuntimeError, match=moved + r" during the backward.*both a forward hook.*"
                                               r"Keep the backward hook's state on another object"):
        trainer.train_episode(EPISODES[0])


@pytest.mark.parametrize("backward", ["module", "parameter", "last"])
@pytest.mark.parametrize("policy", [dict(checkpoint="step"), dict(checkpoint="revolve", slots=2)])
def test_a_monitor_split_as_the_refusal_advises_trains_as_stock(policy, backward):
    expected, got = run(monitored(True, backward)), run(monitored(True, backward), policy)
    assert got[0] == pytest.approx(expected[0], rel=1e-12, abs=0)
    for w, s in zip(got[1], expected[1], strict=True):
        assert torch.allclose(w, s, rtol=1e-11, atol=1e-15)
    (activations, gradients), (stock_activations, stock_gradients) = got[2], expected[2]
    assert len(activations) == 2 * 4 and activations == pytest.approx(stock_activations, rel=1e-12, abs=0)
    assert len(gradients) == len(stock_gradients) > 0 and stock_gradients[-1] > 0  # "last": bound by the backward
    assert gradients == pytest.approx(stock_gradients, rel=1e-10, abs=0)


def test_a_wrapper_around_the_installed_step_runs_it_once():
    """A wrapper holding the installed fused step (taken from the engine while an episode ran):
    called by it, that step stands for the class's (it used to hand the call back to the wrapper,
    without end)."""
    trainer = qca_lowmem.enable(make_trainer(), checkpoint="none")
    read = logged_step(trainer, trainer._qca_lowmem_state.undo.installed_step)
    psi = torch.randn(1, 8, 8, 2, dtype=torch.complex128)
    out = trainer.motor.evolve_step(psi)
    assert read(trainer) == 1 and out.shape == psi.shape


def test_followed_engine_and_injector_are_not_read():
    trainer = qca_lowmem.enable(make_trainer())
    installed = trainer._qca_lowmem_state.undo.installed_step
    assert engine_code(trainer.motor, installed) is None
    assert injector_code(trainer.noise_injector) is None
    STEP_STATE_EDITS["engine counting its calls"][0](trainer)
    assert engine_code(trainer.motor, installed)
    assert injector_code(LoggingInjector())
