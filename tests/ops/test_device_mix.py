"""Every op refuses tensors on different devices, meta included, before it dispatches.

A CPU tensor mixed with a meta tensor dispatches to the Meta kernel (the fake kernel), which
must name the argument and both devices as the C glue does, not return uninitialised memory.
qca_pack, qca_pack_backward, phase_flip, bit_flip and max_pool2x2 take one tensor, noise_coin none:
nothing to mix.
"""

import re

import pytest
import torch

import qca_lowmem
from helpers import CUDA

OPS = torch.ops.qca_lowmem
SECOND = ["meta"] + (["cuda"] if CUDA else [])


def qca_update_args():
    psi = torch.randn(1, 3, 4, 2, dtype=torch.complex64)
    return "qca_update", OPS.qca_update, dict(psi=psi, delta=torch.randn(1, 4, 3, 4)), (0.0, True, 1e-9)


def qca_update_backward_args():
    psi = torch.randn(1, 3, 4, 2, dtype=torch.complex64)
    tensors = dict(grad_out=torch.randn_like(psi), psi=psi, delta=torch.randn(1, 4, 3, 4))
    return "qca_update_backward", OPS.qca_update_backward, tensors, (0.0, True, 1e-9)


def gn_tensors(with_stats=False, with_grad=False):
    x = torch.randn(2, 4, 3, 3)
    tensors = dict(x=x, weight=torch.randn(4), bias=torch.randn(4))
    if with_stats:
        tensors.update(mean=torch.zeros(2, 2), rstd=torch.ones(2, 2))
    if with_grad:
        tensors = dict(grad_y=torch.randn_like(x), **tensors)
    return tensors


def block_tensors():
    return dict(x=torch.randn(1, 3, 4, 4), conv1_weight=torch.randn(8, 3, 3, 3), norm1_weight=torch.ones(8),
                norm1_bias=torch.zeros(8), conv2_weight=torch.randn(8, 8, 3, 3), norm2_weight=torch.ones(8),
                norm2_bias=torch.zeros(8))


CASES = {
    "qca_update": qca_update_args,
    "qca_update_backward": qca_update_backward_args,
    "groupnorm_elu": lambda: ("groupnorm_elu", OPS.groupnorm_elu, gn_tensors(), (2, 1e-5)),
    "groupnorm_elu_apply": lambda: ("groupnorm_elu_apply", OPS.groupnorm_elu_apply, gn_tensors(True), ()),
    "groupnorm_elu_backward": lambda: ("groupnorm_elu_backward", OPS.groupnorm_elu_backward,
                                       gn_tensors(True, True), ()),
    "conv_block": lambda: ("conv_block", OPS.conv_block, block_tensors(), (2, 2, 1e-5, 1e-5)),
    "conv_block_keep": lambda: ("conv_block", OPS.conv_block_keep, block_tensors(), (2, 2, 1e-5, 1e-5)),
    "step_difference": lambda: ("step_difference", OPS.step_difference,
                                dict(actual=torch.randn(3, 4), expected=torch.randn(3, 4), before=torch.randn(3, 4)),
                                ()),
    "max_pool2x2_backward": lambda: ("max_pool2x2_backward", OPS.max_pool2x2_backward,
                                     dict(grad_y=torch.randn(1, 2, 2, 2), x=torch.randn(1, 2, 4, 4)), ()),
    "amp_update_scale_": lambda: ("amp_update_scale_", OPS.amp_update_scale_,
                                  dict(scale=torch.ones(1), growth_tracker=torch.zeros(1, dtype=torch.int32),
                                       found_inf=torch.zeros(1)), (2.0, 0.5, 2000)),
}


def mixes():
    """Each tensor argument of each op moved alone to another device."""
    for case, make in CASES.items():
        for name in make()[2]:
            for device in SECOND:
                yield pytest.param(case, name, device, id=f"{case}-{name}-{device}")


@pytest.mark.parametrize("case, moved, device", list(mixes()))
def test_device_mix_names_the_argument_and_both_devices(case, moved, device):
    op_name, op, tensors, scalars = CASES[case]()
    tensors[moved] = tensors[moved].to(device)
    with pytest.raises(RuntimeError) as error:
        op(*tensors.values(), *scalars)
    message = str(error.value)
    assert message.startswith(f"{op_name}: "), message
    # "<op>: A must be on the same device as B (dev_b), got Tensor(..., device=dev_a, ...)"
    pattern = r"(\w+) must be on the same device as (\w+) \((\w+)(?::\d+)?\), got Tensor\(.*device=(\w+)"
    found = re.search(pattern, message)
    assert found, message
    assert moved in (found.group(1), found.group(2)), message
    assert {found.group(3), found.group(4)} == {"cpu", device}, message


@pytest.mark.parametrize("device", SECOND)
def test_scaler_lists_name_the_mixed_tensor(device):
    grads = [torch.ones(3), torch.ones(2).to(device)]
    with pytest.raises(RuntimeError, match=rf"amp_unscale_: every tensor of grads must be on one device \(cpu, "
                                           rf"from grads\[0\]\); grads\[1\] is Tensor\(.*device={device}"):
        OPS.amp_unscale_(grads, torch.zeros(1), torch.ones(1))
    with pytest.raises(RuntimeError, match=rf"amp_mul_: factor must be on the same device as the first tensor of "
                                           rf"the list \(cpu\), got Tensor\(.*device={device}"):
        OPS.amp_mul_([torch.ones(3)], torch.ones(1).to(device))
    with pytest.raises(RuntimeError, match=rf"found_inf must be on the same device as the first tensor of the list "
                                           rf"\({device}(:0)?\), got Tensor\(.*device=cpu"):
        OPS.amp_unscale_([torch.ones(3).to(device)], torch.zeros(1), torch.ones(1).to(device))
    with pytest.raises(RuntimeError, match=rf"accumulate_: every tensor must be on the device of accumulators\[0\] \(cpu\); "
                                           rf"grads\[0\] is Tensor\(.*device={device}"):
        OPS.accumulate_([torch.ones(3)], [torch.ones(3).to(device)])


def test_fused_block_with_meta_input_and_cpu_parameters_raises():
    block = qca_lowmem.FusedConvBlock(3, 8)
    with pytest.raises(RuntimeError, match=r"conv_block: conv1_weight must be on the same device as x \(meta\)"):
        block(torch.randn(1, 3, 4, 4, device="meta"))


def test_all_meta_still_gives_shapes():
    """The checks refuse mixes only: one device, meta included, still runs the fake kernel."""
    psi = torch.randn(1, 3, 4, 2, dtype=torch.complex64, device="meta")
    out = OPS.qca_update(psi, torch.randn(1, 4, 3, 4, device="meta"), 0.0, True, 1e-9)
    assert out.device.type == "meta" and out.shape == psi.shape
    y, mean, _ = OPS.groupnorm_elu(*(t.to("meta") for t in gn_tensors().values()), 2, 1e-5)
    assert y.device.type == "meta" and mean.shape == (2, 2)
