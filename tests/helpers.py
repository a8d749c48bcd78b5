"""What the tests of several layers share: the devices, models with a visible affine, the episode
harness (an episode's gradients, compared with the full graph's) and the trainer's tiny run.
Imported as `helpers` (tests/conftest.py puts tests/ on the path): test modules import from here,
never from each other or from a conftest (which one `conftest` names depends on the folder)."""

import contextlib
import importlib
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import yaml
from torch import nn

import qca_lowmem
from qca_lowmem import stock

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_module(name: str):
    """benchmarks/<name>.py, imported as the scripts import each other (benchmarks/ on the path)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def follow(monkeypatch, *classes, origin="a test's class"):
    """`classes` recorded as the users' code qca_lowmem follows on this Python, as
    scripts/record_digests.py records their model families' (code_identity.FOLLOWED's "modules")."""
    from qca_lowmem.atheria import code_identity  # noqa: PLC0415  (the switch's own module, for its record)
    entry = dict(code_identity.FOLLOWED.get(code_identity.PYTHON, {}))
    modules = dict(entry.get("modules", {}))
    for cls in classes:
        digest = code_identity.class_digest(cls)
        assert digest is not None, f"{cls.__qualname__}'s code cannot be digested"
        modules[digest] = f"{origin} {cls.__qualname__}"
    entry["modules"] = modules
    monkeypatch.setitem(code_identity.FOLLOWED, code_identity.PYTHON, entry)


@contextlib.contextmanager
def single_thread():
    """Tiny tensors gain nothing from threads, and on a shared machine the intra-op pool's
    spin-waits make them many times slower (the trainer's tiny run: 12 s, 2 s on one thread);
    one thread keeps the runtime predictable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def randomize_affine(module: nn.Module, generator=None) -> nn.Module:
    """Give every GroupNorm a non-trivial affine (stock init is 1 and 0), so tests see it."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.GroupNorm):
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=generator))
                m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=generator))
    return module


def batchnorm_step():
    """(conv, norm, step): a float64 step through a conv and a BatchNorm in train mode, which
    updates its running statistics at every call; made afresh from seed 0."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 4, 3, padding=1).double()
    norm = nn.BatchNorm2d(4).double()

    def step(psi):
        x = qca_lowmem.qca_pack(psi)
        return qca_lowmem.qca_update(psi, 0.1 * torch.tanh(norm(conv(x))), 0.05)

    return conv, norm, step


# ---------------------------------------------------------------- episodes

STEPS, RECORD_EVERY = 11, 3  # episode_grads' episode: recorded steps 0, 3, 6, 9, 10


def initial_state(device="cpu", dtype=torch.complex128, grid=8, d_state=2):
    torch.manual_seed(3)
    return stock.initial_state(1, grid, d_state, dtype=dtype).to(device)


def make_conv_net(dtype=torch.float64, device="cpu", d_state=2):
    torch.manual_seed(2)
    c = 2 * d_state
    return nn.Sequential(nn.Conv2d(c, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, c, 3, padding=1)).to(device=device, dtype=dtype)


def fused_step(net):
    """An additive-mode step on the fused ops: qca_pack -> conv net -> qca_update."""
    return lambda psi: qca_lowmem.qca_update(psi, net(qca_lowmem.qca_pack(psi)), gamma=0.05, multiplicative=False)


def noisy_schedule():
    schedule = qca_lowmem.NoiseSchedule(0.5, 2000, seed=1)  # bit flips at steps 2, 3, 4 and 10
    assert schedule.active and any(schedule.bit_flips_at(t) for t in range(STEPS))
    return schedule


class Episode(NamedTuple):
    loss: torch.Tensor  # detached
    grads: list  # psi0's, the carry entries' that require grad, then the parameters'
    length: int  # of the history
    carry: tuple | None  # the final carry, detached


def episode(step, params, psi0, steps, loss, carry=None, **options) -> Episode:
    """rollout(step, psi0, steps, **options) from psi0 (and `carry`) as new leaves, the parameters'
    gradients cleared first, and loss(psi0, psi_T, history[, carry_T]) back-propagated."""
    for p in params:
        p.grad = None
    psi0 = psi0.detach().requires_grad_()
    leaves = [psi0]
    if carry is not None:
        carry = tuple(m.detach().requires_grad_() if m is not None and m.requires_grad else m for m in carry)
        leaves += [m for m in carry if m is not None and m.requires_grad]
        options["carry"] = carry
    result = qca_lowmem.rollout(step, psi0, steps, **options)  # psi_T, history[, carry_T]
    value = loss(psi0, *result)
    value.backward()
    # The final carry detached: kept with its graph, it would hold the parameters' gradient
    # accumulators, made on the default stream, and a later StepGraph's backward capture cannot
    # sync with it.
    carry_T = None if carry is None else tuple(None if m is None else m.detach() for m in result[2])
    return Episode(value.detach(), [x.grad for x in leaves] + [p.grad for p in params], len(result[1]), carry_T)


def episode_loss(psi_T, history, psi0, history_loss):
    """The evolutionary loss, plus random weights on every recorded state but the last when
    `history_loss` (so the history's gradients count too)."""
    loss, _ = stock.evolutionary_loss(history, psi0)
    if history_loss:
        torch.manual_seed(4)
        for h in history[:-1]:
            weight = torch.randn(h.shape, dtype=h.real.dtype, device=h.device)
            loss = loss + (weight * h.real).sum() + (weight.flip(1) * h.imag**2).sum()
    return loss


def episode_grads(step_fn, params, psi0, checkpoint, slots=None, noise=None, history_loss=False, steps=STEPS):
    """The gradients of psi0 and `params` through an episode of `steps` under `checkpoint`."""
    return episode(step_fn, params, psi0, steps, lambda psi0, psi_T, history: episode_loss(psi_T, history, psi0, history_loss),
                   checkpoint=checkpoint, slots=slots, noise=noise, record_every=RECORD_EVERY).grads


def max_relative_error(grads, expected):
    assert len(grads) == len(expected)
    errors = []
    for g, e in zip(grads, expected):
        assert g is not None and e is not None
        errors.append(((g - e).abs().max() / e.abs().max()).item())
    return max(errors)


# ---------------------------------------------------------------- episodes with a carry

CARRY_STEPS, HIDDEN = 7, 3


class MemoryCell(nn.Module):
    """A ConvLSTM-shaped operator: (x, h, c) -> (delta, h, c), a zero memory when h, c are None."""

    def __init__(self, d_state=2):
        super().__init__()
        torch.manual_seed(11)
        c = 2 * d_state
        self.gates = nn.Conv2d(c + HIDDEN, 4 * HIDDEN, 3, padding=1)
        self.out = nn.Conv2d(c + HIDDEN, c, 3, padding=1)

    def forward(self, x, h=None, c=None):
        if h is None:
            h = c = x.new_zeros(x.shape[0], HIDDEN, *x.shape[2:])
        f, i, o, g = self.gates(torch.cat([x, h], 1)).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return 0.3 * torch.tanh(self.out(torch.cat([x, h], 1))), h, c


def memory_step(cell, detach):
    """One QCA step carrying (h, c); `detach` cuts the gradient through the memory, as the users'
    engine does."""

    def step(psi, memory):
        h, c = (m.detach() if detach and m is not None else m for m in memory)
        delta, h, c = cell(qca_lowmem.qca_pack(psi), h, c)
        if detach:
            h, c = h.detach(), c.detach()
        return qca_lowmem.qca_update(psi, delta, gamma=0.05, multiplicative=False), (h, c)

    return step


def initial_memory(grid=8, requires_grad=False):
    torch.manual_seed(4)
    h, c = (0.5 * torch.randn(1, HIDDEN, grid, grid, dtype=torch.float64) for _ in range(2))
    return h.requires_grad_(requires_grad), c.requires_grad_(requires_grad)


def carried_grads(step, cell, psi0, memory0, checkpoint, slots=None, noise=None, memory_loss=True, **options):
    """The episode's loss (on the history, and on the final memory when `memory_loss`), the
    gradients of psi0, the memory entries that require grad and every parameter, the final memory."""

    def loss(psi0, psi_T, history, memory_T):
        value, _ = stock.evolutionary_loss(history, psi0)
        if memory_loss:
            value = value + (memory_T[0] * torch.linspace(-1, 1, memory_T[0].numel(),
                                                          device=memory_T[0].device).view_as(memory_T[0])).sum()
            value = value + memory_T[1].square().sum()
        return value

    run = episode(step, list(cell.parameters()), psi0, CARRY_STEPS, loss, carry=memory0, checkpoint=checkpoint,
                  slots=slots, noise=noise, record_every=2, **options)
    return run.loss, run.grads, run.carry


# ---------------------------------------------------------------- the trainer's tiny run

# The tiny CLI run the trainer's error and safety tests share.
TINY = {
    "model": {"d_state": 2, "hidden": 8},
    "training": {"grid": 8, "qca_steps": 5, "episodes": 2, "seed": 3},
    "output": {"save_every": 1},
    "device": "cpu",
}


def report_lines(stderr: str):
    """A run's stderr less its own progress notes (where it trains, how long the first episode
    took): what it reports besides them."""
    notes = ("qca-lowmem: training episodes ", "qca-lowmem: first episode ")
    return [line for line in stderr.splitlines() if not line.startswith(notes)]


def write_config(path: Path, config=None, text=None) -> str:
    path.write_text(text if text is not None else yaml.safe_dump(config if config is not None else TINY))
    return str(path)


def full_step_bytes(step, psi, carry=None) -> int:
    """What one step's full graph keeps (blocks keeping their intermediates) plus its output
    state, as checkpoint="auto" counts a step it keeps whole."""
    with torch.enable_grad(), qca_lowmem.keep_block_intermediates():
        if carry is None:
            return qca_lowmem.saved_bytes(step, psi.detach().requires_grad_(True)) + psi.nbytes
        return qca_lowmem.saved_bytes(step, psi.detach().requires_grad_(True), carry) + psi.nbytes + \
            sum(c.nbytes for c in carry)


# Ops after which the host waits for a GPU to finish: a boolean index or mask (nonzero, masked_select)
# and a scalar read (.item(), a Python bool of a tensor). Counted on any device by the profiler,
# which records the ops a composite one calls (a boolean index's nonzero) too.
HOST_WAIT_OPS = ("aten::nonzero", "aten::masked_select", "aten::_local_scalar_dense")


def host_waits(fn) -> int:
    """How many ops `fn()` runs that make the host wait for a GPU."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn()
    return sum(event.name in HOST_WAIT_OPS for event in profile.events())


def op_names(fn) -> set:
    """The names of the ops the profiler records while fn() runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn()
    return {event.name for event in profile.events()}


def pool_specials(shape, dtype, channels_last=False, generator=None):
    """A max pooling's input where its rules decide: small integers, so windows tie, with NaN and
    -infinity among them (-3 and -2: some windows hold four -infinities)."""
    x = torch.randint(-3, 3, shape, generator=generator).to(torch.float64)
    x[x == 2] = float("nan")
    x[x <= -2] = float("-inf")
    return x.to(dtype).contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def inside(event, name: str) -> bool:
    """Whether a profiler event ran inside an op of this name."""
    event = event.cpu_parent
    while event is not None:
        if event.name == name:
            return True
        event = event.cpu_parent
    return False


def gradient_casts_in(episode) -> int:
    """aten::_to_copy calls from bfloat16 3x3 conv weight gradients back to float32."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        episode()
    return sum(1 for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes
               and len(e.input_shapes[0]) == 4 and e.input_shapes[0][2:] == [3, 3]
               and e.input_dtypes[0] == "c10::BFloat16")


@contextlib.contextmanager
def classes_in_episodes(trainer):
    """A list that gets, at each enabled episode of `trainer`, the classes of its operator's modules
    as the episode runs (the stand-ins' there: fused blocks, pools, convs; theirs between episodes)."""
    from qca_lowmem.atheria import switch

    seen, real = [], switch.train_episode

    def recording(enabled, *args, **kwargs):
        seen.append([type(m) for m in enabled.motor.operator.modules()])
        return real(enabled, *args, **kwargs)

    switch.train_episode = recording
    try:
        yield seen
    finally:
        switch.train_episode = real


def weight_casts_in(episode) -> int:
    """aten::_to_copy calls from float32 3x3 conv weights (the fused blocks'), by the profiler; the
    gradients' casts back to float32 are not weight casts. A cast made under a dispatch mode (the
    rollout's probe watches its first step's ops) is one cast that the profiler lists twice, once
    inside the other."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        episode()
    return sum(1 for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes
               and len(e.input_shapes[0]) == 4 and e.input_shapes[0][2:] == [3, 3] and e.input_dtypes[0] == "float"
               and not inside(e, "PythonDispatchMode"))


def casts_in(fn, tensors) -> int:
    """aten::_to_copy calls of a tensor shaped as one of `tensors` (parameters: their casts and
    their gradients') while fn() runs, by the profiler: not those inside torch's CPU convolutions,
    one made under a dispatch mode (listed twice) counted once."""
    shapes = [[list(t.shape)] for t in tensors]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()

    def ancestors(event):
        while (event := event.cpu_parent) is not None:
            yield event.name

    return sum(1 for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes[:1] in shapes
               and not any(name == "PythonDispatchMode" or "convolution" in name for name in ancestors(e)))


@qca_lowmem.keeps_values  # so the fused paths run under it, as without it
class RecordingMode(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that is not a watcher: it sees each op (its name in `seen`) and runs it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))
