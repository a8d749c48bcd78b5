"""The fused blocks' half-precision weights are cast once per episode, or once for the episodes
of a shared_weight_casts() scope (one optimizer step's): the same values and gradients, bit for
bit, as casting at every call; the number of casts does not grow with the number of steps or of
episodes, and a weight changed in place is cast again."""

import contextlib
import csv

import pytest
import torch
import yaml

import qca_lowmem
from helpers import TINY, gradient_casts_in, inside, randomize_affine, weight_casts_in
from qca_lowmem import rollout
from qca_lowmem.ops.qca_step import fused_step
from qca_lowmem.recompute import weight_casts
from qca_lowmem.trainer import cli
from qca_lowmem.trainer import train as train_mod

pytestmark = pytest.mark.usefixtures("one_thread")

MODES = [("none", None), ("step", None), ("revolve", 2)]


def fused_unet(d_state=2, hidden=8):
    torch.manual_seed(1)
    unet = randomize_affine(qca_lowmem.UNetUnitary(d_state, hidden))
    with torch.no_grad():
        unet.outc.weight.normal_(0.0, 0.3)
    return unet


def bf16_episode(unet, steps, checkpoint, slots):
    """psi_T, the gradient w.r.t. psi0 and the parameters' gradients of a bf16 autocast episode."""
    for p in unet.parameters():
        p.grad = None
    return accumulate_episode(unet, steps, checkpoint, slots) + [p.grad for p in unet.parameters()]


def accumulate_episode(unet, steps, checkpoint, slots, seed=3):
    """[psi_T, the gradient w.r.t. psi0] of a bf16 autocast episode from psi0 drawn with `seed`;
    the parameters' gradients are added to their .grad."""
    torch.manual_seed(seed)
    psi0 = qca_lowmem.stock.initial_state(1, 8, 2).requires_grad_()
    noise = qca_lowmem.NoiseSchedule(0.5, 2000, seed=seed - 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        psi_T, history = rollout(fused_step(unet, 0.0, True), psi0, steps, checkpoint=checkpoint, slots=slots,
                                 noise=noise, record_every=2)
        loss, _ = qca_lowmem.stock.evolutionary_loss(history, psi0)
    loss.backward()
    return [psi_T.detach(), psi0.grad]


@pytest.fixture
def cast_per_call(monkeypatch):
    def install():
        monkeypatch.setattr(weight_casts.WeightCasts, "active", lambda self: contextlib.nullcontext())

    return install


@pytest.mark.parametrize("checkpoint,slots", MODES)
def test_bitwise_the_same_as_casting_per_call(checkpoint, slots, cast_per_call):
    unet = fused_unet()
    cached = bf16_episode(unet, 5, checkpoint, slots)
    cast_per_call()
    per_call = bf16_episode(unet, 5, checkpoint, slots)
    assert all(g is not None for g in cached)
    assert all(torch.equal(a, b) for a, b in zip(cached, per_call))


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint,slots", MODES)
def test_weight_casts_per_episode_do_not_grow_with_steps(checkpoint, slots, cast_per_call):
    unet = fused_unet()
    fused_convs = 2 * sum(isinstance(m, qca_lowmem.FusedConvBlock) for m in unet.modules())
    counts = [weight_casts_in(lambda: bf16_episode(unet, steps, checkpoint, slots)) for steps in (3, 9)]
    assert counts == [fused_convs, fused_convs]
    cast_per_call()  # the count sees the casts: per call they grow with the steps
    assert weight_casts_in(lambda: bf16_episode(unet, 3, checkpoint, slots)) > 3 * fused_convs


@pytest.mark.parametrize("checkpoint,slots", MODES)
def test_unfused_layers_weights_are_cast_once_per_episode_too(checkpoint, slots, cast_per_call):
    """The transposed convolutions and the output convolution run outside the fused blocks: their
    weights come from the episode's copies as well, not from autocast's cast at every call."""
    unet = fused_unet()
    unfused = [unet.up1, unet.up2, unet.outc]
    shapes = [list(layer.weight.shape) for layer in unfused] + [list(layer.bias.shape) for layer in unfused]
    counts = [_casts_of(shapes, lambda: bf16_episode(unet, steps, checkpoint, slots)) for steps in (3, 9)]
    assert counts == [len(shapes), len(shapes)]
    cast_per_call()
    assert _casts_of(shapes, lambda: bf16_episode(unet, 3, checkpoint, slots)) > 3 * len(shapes)


def _casts_of(shapes, episode):
    """aten::_to_copy calls from float32 tensors of these shapes, by the profiler (as weight_casts_in)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        episode()
    return sum(1 for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes
               and e.input_shapes[0] in shapes and e.input_dtypes[0] == "float"
               and not inside(e, "PythonDispatchMode"))


@pytest.mark.parametrize("checkpoint,slots", MODES)
def test_recomputing_backward_adds_half_gradients_without_casting_them(checkpoint, slots):
    """In a recomputing backward each step's bf16 weight gradient is added to the fp32 sum
    directly; plain autograd casts each to fp32 first, as per-call casting does."""
    unet = fused_unet()
    steps = 3
    casts = gradient_casts_in(lambda: bf16_episode(unet, steps, checkpoint, slots))
    assert casts == (steps * fused_convs_of(unet) if checkpoint == "none" else 0)


def fused_convs_of(unet):
    return 2 * sum(isinstance(m, qca_lowmem.FusedConvBlock) for m in unet.modules())


def accumulated_episodes(unet, checkpoint, slots, shared, seeds=(3, 4, 5)):
    """Each episode's psi_T and psi0 gradient, then the parameters' gradients summed over them."""
    for p in unet.parameters():
        p.grad = None
    results = []
    with qca_lowmem.shared_weight_casts() if shared else contextlib.nullcontext():
        for seed in seeds:
            results += accumulate_episode(unet, 4, checkpoint, slots, seed)
    return results + [p.grad for p in unet.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint,slots", MODES)
def test_episodes_accumulated_in_a_shared_scope_cast_once(checkpoint, slots, cast_per_call):
    unet = fused_unet()
    fused_convs = fused_convs_of(unet)
    assert weight_casts_in(lambda: accumulated_episodes(unet, checkpoint, slots, shared=True)) == fused_convs
    assert weight_casts_in(lambda: accumulated_episodes(unet, checkpoint, slots, shared=False)) == 3 * fused_convs
    shared = accumulated_episodes(unet, checkpoint, slots, shared=True)
    cast_per_call()
    per_call = accumulated_episodes(unet, checkpoint, slots, shared=False)
    assert all(g is not None for g in shared) and len(shared) == len(per_call)
    assert all(torch.equal(a, b) for a, b in zip(shared, per_call))


@pytest.mark.slow
def test_a_weight_changed_inside_the_scope_is_cast_again(cast_per_call):
    unet = fused_unet()
    initial = {k: v.clone() for k, v in unet.state_dict().items()}
    convs = [m.conv_block[i].weight for m in unet.modules() if isinstance(m, qca_lowmem.FusedConvBlock) for i in (0, 3)]

    def two_steps():
        """An episode, an optimizer step, an episode, all in one scope: outputs and gradients."""
        unet.load_state_dict(initial)
        optimizer = torch.optim.SGD(unet.parameters(), lr=0.5)
        optimizer.zero_grad(set_to_none=True)
        with qca_lowmem.shared_weight_casts():
            first = accumulate_episode(unet, 4, "step", None, seed=3)
            first += [p.grad.clone() for p in unet.parameters()]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            second = accumulate_episode(unet, 4, "step", None, seed=4)
        return first + second + [p.grad for p in unet.parameters()]

    assert weight_casts_in(two_steps) == 2 * fused_convs_of(unet)
    stepped = [w.to(torch.bfloat16) for w in convs]
    shared = two_steps()
    unet.load_state_dict(initial)
    assert all(not torch.equal(w.to(torch.bfloat16), s) for w, s in zip(convs, stepped))  # a stale copy differs
    cast_per_call()
    per_call = two_steps()
    assert all(torch.equal(a, b) for a, b in zip(shared, per_call))


def test_leaving_the_scope_drops_its_copies():
    unet = fused_unet()
    psi0 = qca_lowmem.stock.initial_state(1, 8, 2)
    with qca_lowmem.shared_weight_casts():
        casts = weight_casts.for_episode()
        with qca_lowmem.shared_weight_casts():
            assert weight_casts.for_episode() is casts  # nested: the outer scope's copies
        with torch.autocast("cpu", dtype=torch.bfloat16):
            psi_T, _ = rollout(fused_step(unet, 0.0, True), psi0, 2)
        assert len(casts._copies) == fused_convs_of(unet) + 6  # and the unfused layers' weights and biases
    assert psi_T.grad_fn is not None and not casts._copies  # the episode's graph lives on, the copies do not
    assert weight_casts.for_episode() is not weight_casts.for_episode()  # outside a scope: one per episode



def test_the_optimizer_hook_lives_only_while_a_scope_is_open():
    """No process-wide optimizer hook outlives the scopes that need it; an optimizer step inside
    one drops its copies."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    before = len(_global_optimizer_post_hooks)
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    with qca_lowmem.shared_weight_casts():
        assert len(_global_optimizer_post_hooks) == before + 1
        casts = weight_casts.for_episode()
        casts.copy_of(weight, torch.bfloat16)
        weight.grad = torch.ones(3)
        optimizer.step()
        assert not casts._copies
    assert len(_global_optimizer_post_hooks) == before


@pytest.mark.slow
def test_trainer_casts_once_per_optimizer_step_with_the_same_weights(tmp_path, monkeypatch):
    config = {**TINY, "training": {**TINY["training"], "episodes": 4, "accumulate": 2, "max_noise": 1.0},
              "lowmem": {"checkpoint": "step", "amp_dtype": "bf16"}, "output": {"save_every": 2}}
    path = tmp_path / "bf16.yaml"
    path.write_text(yaml.safe_dump(config))
    runs = {}

    def train(out):
        assert cli.main(["train", "--config", str(path), "--out", str(tmp_path / out), "--no-progress"]) == 0
        state = torch.load(tmp_path / out / "checkpoint.pt", weights_only=False)
        assert state["episode"] == 4
        with open(tmp_path / out / "metrics.csv", newline="") as f:
            rows = [{k: v for k, v in row.items() if k != "seconds"} for row in csv.DictReader(f)]
        runs[out] = state["model_state_dict"], rows

    casts = {"shared": weight_casts_in(lambda: train("shared"))}
    monkeypatch.setattr(train_mod, "shared_weight_casts", contextlib.nullcontext)  # as before: one per episode
    casts["per_episode"] = weight_casts_in(lambda: train("per_episode"))
    assert casts["shared"] == 2 * fused_convs_of(fused_unet(2, 8))  # two optimizer steps
    assert casts["per_episode"] > casts["shared"]
    (shared, shared_rows), (per_episode, per_episode_rows) = runs["shared"], runs["per_episode"]
    assert shared.keys() == per_episode.keys() and all(torch.equal(shared[k], per_episode[k]) for k in shared)
    assert shared_rows == per_episode_rows and len(shared_rows) == 4  # losses, metrics, saved bytes
