"""enable()'s options, as given, declared once (`Options`): each field's type, default, check and
doc. enable()'s signature and docstring, the `LOWMEM` section's keys, which of them are flags, and
the keys the reference trainer's `lowmem` section shares are read off these fields; an option is
one field here (and what it does where it is read)."""

import inspect
import math
import numbers
import re
import textwrap
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch

from ..precision import parse_amp_dtype
from ..recompute import Policy
from ..recompute.policy import MODES, STEP

NOISE_SOURCES = ("trainer", "fused")
_FLAG = "True or False"


def option(default, doc: str, expected: str = _FLAG, accepts: Optional[Callable[[Any], bool]] = None, *,
           lowmem_key: bool = False, positional: bool = False):
    """A field of Options. `expected`: what a refusal says it takes; `accepts(value)`: whether a value
    is of its type (None where allowed included; a flag's is read off its type); `lowmem_key`: the
    reference trainer's `lowmem` section has it too; `positional`: enable() takes it by position too."""
    return field(default=default, metadata=dict(doc=doc, expected=expected, accepts=accepts, lowmem_key=lowmem_key,
                                                positional=positional))


def _positive_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _is_amp_dtype(value) -> bool:
    try:
        parse_amp_dtype(value)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Options:
    """enable()'s keyword arguments, checked by type as made (a refusal names the option and the value)."""

    checkpoint: Union[str, Policy] = option(
        STEP, '"step" (keep one psi per step, recompute in backward), "revolve" (binomial checkpointing with '
        '`slots` stored states), "auto" (full graphs of as many steps as `budget` bytes allow, the others '
        'recomputed; see rollout) or "none" (stock autograd); or a Policy.',
        f"one of {MODES} or a Policy", lambda v: isinstance(v, Policy) or isinstance(v, str) and v in MODES,
        lowmem_key=True, positional=True)
    amp_dtype: Optional[Union[str, torch.dtype]] = option(
        None, 'None follows the trainer (fp16 autocast when `trainer.use_amp`, read at enable(): an episode after '
        'it changes enables it again, reading it anew, said in one line; a train_episode called inside an '
        'autocast of the caller\'s, which the trainer\'s episode would run in, refuses), else "fp32", "bf16" '
        'or "fp16", whatever the caller\'s autocast; '
        "the state and its normalisation stay complex64 either way. bf16 on a GPU below compute capability 8.0 "
        "(emulated there) becomes fp16 with the loss scaler, with a warning.",
        "one of None, 'fp32', 'bf16', 'fp16' (or a torch dtype)", _is_amp_dtype, lowmem_key=True, positional=True)
    fused_blocks: bool = option(
        True, "fuse the operator's ConvBlocks in place (the same modules and Parameters), run its 2x2 "
        "nn.MaxPool2d layers on qca_lowmem's op (torch's bits, no indices kept), and under autocast give its "
        "other convs the episode's half-precision weight copies (cast once an episode, autocast's values).",
        lowmem_key=True, positional=True)
    # slots and budget: their ranges, and which checkpoint reads them, are Policy.of's
    slots: Optional[int] = option(
        None, 'the states "revolve" keeps.', "an int >= 1 or None", lambda v: v is None or _positive_int(v),
        lowmem_key=True, positional=True)
    cuda_graph: Optional[bool] = option(
        None, "run each recomputed step as replays of captured CUDA graphs (qca_lowmem.StepGraph): the same "
        "kernels without launch overhead. None (the default): on where it can run (CUDA with torch's caching "
        'allocator, a checkpoint other than "none", an engine and an operator whose code qca_lowmem follows: a '
        "replay repeats one call, and only code it follows is known to do the same at every call), off elsewhere; "
        "True where it cannot run warns why, once, and is refused for code it does not follow; False: eager steps. "
        "enable()'s line says which on CUDA.",
        "True, False or None (on where it can run)", lowmem_key=True, positional=True)
    fused_step_ops: bool = option(
        True, "replace `motor.evolve_step` by the fused pack/update ops while an episode runs (between episodes the "
        "engine has its own). Only where that is exact: an engine "
        "whose state psi is not a complex tensor is refused naming its class; one whose evolve_step is not, by "
        "the identity of its code, a Cartesian step qca_lowmem follows (checked again at each episode), whose "
        "operator runs code it does not follow (a class of the user's not recorded: never called to probe it) "
        "or an op not known continuous (spikes, quantising: the ops of one probe call tell), keeps "
        "the engine's own step and stock blocks, which round as stock does, and enable()'s line says so. False "
        "rolls out the engine's own step, which needs only the complex tensor state (and, for a compiled operator, "
        'checkpoint="none": a recompute would run another compiled graph than its forward).')
    lowmem_scaler: bool = option(
        True, "replace `trainer.scaler` (torch's GradScaler; a subclass of theirs is kept) by "
        "qca_lowmem.amp.GradScaler carrying its state, and back at disable() unless they set another since. The "
        "loss is scaled "
        "where their episode would scale it (V4: `use_amp` and a scaler; V3: never), or for an fp16 amp_dtype.")
    grid_size: Optional[Union[int, Tuple[int, int]]] = option(
        None, "how a V4 trainer's psi0 is drawn, with batch_size, d_state and initial_state. By default the "
        "trainer's own draw from its engine as its episode makes it (`motor.state._reset_state_random()`, then "
        "`motor.state.psi`; their V4 also takes a state's psi unreset, or `motor.get_initial_state(batch_size)` "
        "from an engine without one; grid_size and batch_size, which would replace it, are refused), else the "
        "stand-in's stock draw (batch_size, default 1) on the global torch RNG with the grid from trainer.grid_size "
        "or motor.cfg.GRID_SIZE_TRAINING, read at enable(): an episode after it changes enables it again at the new "
        "grid, said in one line. A V3 trainer "
        "draws its own, `motor.get_initial_state(trainer.batch_size)`, and refuses grid_size and batch_size.",
        "an int >= 1, a pair of ints >= 1 or None", lambda v: v is None or _positive_int(v) or isinstance(
            v, (tuple, list)) and len(v) == 2 and all(_positive_int(side) for side in v))
    batch_size: Optional[int] = option(
        None, "the stock psi0 draw's batch (see grid_size).", "an int >= 1 or None",
        lambda v: v is None or _positive_int(v))
    d_state: Optional[int] = option(
        None, "the state's components per cell, where the trainer does not tell.", "an int >= 1 or None",
        lambda v: v is None or _positive_int(v))
    initial_state: Optional[Callable] = option(
        None, "`initial_state(trainer) -> psi0` overrides the draw (see grid_size), for trainers that draw psi0 "
        "differently.", "a callable initial_state(trainer) -> psi0, or None", lambda v: v is None or callable(v))
    max_grad_norm: Optional[float] = option(
        None, "None clips as the trainer does (V4 at 1.0; V3 at its gradient_clip, when > 0).",
        "a finite number > 0 or None (the trainer's own)", lambda v: v is None or isinstance(v, numbers.Real)
        and not isinstance(v, bool) and math.isfinite(v) and v > 0)
    budget: Optional[Union[int, str]] = option(
        None, 'the bytes "auto" may keep: an int, a size such as "2GiB", or "free" (sized from free GPU memory).',
        "an int >= 0 (bytes), a size such as '2GiB', 'free' or None",
        lambda v: v is None or isinstance(v, str) or isinstance(v, int) and not isinstance(v, bool),
        lowmem_key=True)
    noise: str = option(
        "trainer", "where a noisy episode's noise comes from. \"trainer\": the trainer's own `noise_injector`, "
        "applied as stock applies it (a phase flip, and a bit flip when NumPy's coin says so): the same random "
        "draws in the same order as stock, replayed in recomputes, so episodes equal stock's and leave the "
        "generators as stock leaves them. \"fused\": qca_lowmem's NoiseSchedule (fused kernels keyed by "
        "(seed, step); the same distribution, other numbers than stock's). A V3 trainer's episode has no noise "
        "and reads neither, as enable()'s line says.",
        f"one of {NOISE_SOURCES}", lambda v: isinstance(v, str) and v in NOISE_SOURCES)
    assume_stock_episode: bool = option(
        False, "run qca_lowmem's stock episode in place of a train_episode that is not one it follows (edited, "
        "overridden), at your own risk: what yours does differently is dropped. enable()'s line says so. False "
        "(the default) refuses such a trainer.")
    channels_last: Optional[bool] = option(
        None, "the operator's weights in NHWC (in place, the same Parameters), as the fused pack writes its input "
        "(the engine's own pack does too), so cuDNN's convolutions need no layout conversion; the same function "
        "(float64 within rounding of NCHW weights). None (the "
        "default): on for a CUDA operator whose convolutions run on Tensor Cores (precision.gpu_prefers_nhwc; "
        "measured faster on an H200, docs/benchmarks.md) when it gets the fused step on an engine without "
        "memory, off elsewhere (the CPU included); enable()'s line names it when on. True needs the fused step "
        "on an engine without memory. disable() puts the weights back in NCHW.",
        "True, False or None (on where it measured faster)", lowmem_key=True)

    def __post_init__(self):
        check_options(vars(self), lambda name: f"enable(): {name}")


OPTION_NAMES = tuple(f.name for f in fields(Options))
# The options a LOWMEM section may spell as parse_flag does: the booleans (None, where allowed, is unset).
FLAG_OPTIONS = tuple(f.name for f in fields(Options) if f.type in (bool, Optional[bool]))
LOWMEM_KEYS = tuple(f.name for f in fields(Options) if f.metadata["lowmem_key"])

_YAML_WORDS = {"None": "null", "True": "true", "False": "false"}


def _accepts(option_field, value) -> bool:
    accepts = option_field.metadata["accepts"]
    if accepts is not None:
        return accepts(value)
    return isinstance(value, bool) or option_field.type == Optional[bool] and value is None


def check_options(values: Dict[str, Any], label: Callable[[str], str], yaml: bool = False) -> None:
    """Refuse a value not of its option's type, naming it as `label(name)` does and the value
    (what it takes in YAML's words where `yaml`)."""
    for option_field in fields(Options):
        name = option_field.name
        if name in values and not _accepts(option_field, values[name]):
            value, expected = values[name], option_field.metadata["expected"]
            if yaml:
                expected = re.sub(r"\b(None|True|False)\b", lambda word: _YAML_WORDS[word.group()], expected)
            kind = f" (a {type(value).__name__})" if isinstance(value, (str, bool, float, list, tuple, dict)) else ""
            raise ValueError(f"{label(name)} must be {expected}, got {value!r}{kind}")


def enable_signature() -> inspect.Signature:
    """enable(trainer, <the options>): those enable() takes by position first, the rest by keyword only."""
    kind = {True: inspect.Parameter.POSITIONAL_OR_KEYWORD, False: inspect.Parameter.KEYWORD_ONLY}
    return inspect.Signature(
        [inspect.Parameter("trainer", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [inspect.Parameter(f.name, kind[f.metadata["positional"]], default=f.default, annotation=f.type)
           for f in fields(Options)])


def options_doc(indent: str = "    ") -> str:
    """Each option and its doc, as enable()'s docstring lists them."""
    return "\n".join(textwrap.fill(f"{f.name}: {f.metadata['doc']}", 100, initial_indent=indent,
                                   subsequent_indent=indent + "  ") for f in fields(Options))
