"""enable() gives the operator's nn.MaxPool2d layers the stand-in's class (pools.py) with its fused
blocks, the episodes run max_pool2x2 through them, and disable() gives torch's class back. That
the runs equal stock's, bit for bit, test_families.py shows for every family and policy (there
with torch's pools on the CPU, where the op does not run by default: here it does, as on a GPU)."""

import pytest
from torch import nn

import qca_lowmem
from fixtures.model_families import assert_same_run, make_trainer, run
from helpers import classes_in_episodes, op_names
from qca_lowmem import pools

pytestmark = pytest.mark.usefixtures("one_thread", "max_pool_op_on_the_cpu")


def operator_pools(trainer):
    return [m for m in trainer.motor.operator.modules() if isinstance(m, nn.MaxPool2d)]


def test_the_episodes_swap_the_pools_and_give_them_back():
    """The stand-in's class while an episode runs, torch's between episodes and after disable()."""
    trainer = make_trainer("unet_groupnorm")
    found = operator_pools(trainer)
    assert len(found) == 2 and all(type(m) is nn.MaxPool2d for m in found)
    qca_lowmem.enable(trainer, checkpoint="step")
    assert operator_pools(trainer) == found and all(type(m) is nn.MaxPool2d for m in found)
    with classes_in_episodes(trainer) as classes:
        names = op_names(lambda: run(trainer, episodes=range(1)))
    assert "qca_lowmem::max_pool2x2" in names and "aten::max_pool2d_with_indices" not in names
    assert classes[0].count(pools.MaxPool2d) == 2 and nn.MaxPool2d not in classes[0]
    assert operator_pools(trainer) == found and all(type(m) is nn.MaxPool2d for m in found)
    qca_lowmem.disable(trainer)
    assert operator_pools(trainer) == found and all(type(m) is nn.MaxPool2d for m in found)


def test_the_run_with_the_op_equals_stock():
    expected = run(make_trainer("unet_groupnorm"))
    trainer = make_trainer("unet_groupnorm")
    qca_lowmem.enable(trainer, checkpoint="step")
    assert_same_run(run(trainer), expected)


def test_without_fused_blocks_the_pools_stay_torchs():
    trainer = make_trainer("unet_groupnorm")
    qca_lowmem.enable(trainer, checkpoint="step", fused_blocks=False)
    assert all(type(m) is nn.MaxPool2d for m in operator_pools(trainer))
    assert "qca_lowmem::max_pool2x2" not in op_names(lambda: run(trainer, episodes=range(1)))
