"""bench_episode's runs through the users' trainer: the QC_Trainer_v4 stand-in
(qca_lowmem.examples) set up as they train it (on CUDA: fp16 autocast from `use_amp` and torch's
GradScaler), its noise their injector's (stock.NoiseInjector, boolean masks).

stock_v4: the stand-in's own train_episode. lowmem_enable_default: the same trainer after
`qca_lowmem.enable(trainer)` with every default (step recompute, fp16 from use_amp, the fused
blocks and step, cuda_graph on where it can run, the trainer's noise replayed without host
waits on CUDA, channels_last where enable() turns it on): what `LOWMEM: true` gives them.
lowmem_enable_channels_last and lowmem_enable_nchw: the same with `channels_last=True` and
`channels_last=False`. By name, lowmem_enable_default_overlap: enable()'s defaults with the
StepGraph the switch makes given two lanes (StepGraph(overlap=True), not an enable() option until
a GPU run shows it pays: the switch's StepGraph is replaced for that run's episodes only).
Their weights are the other runs' initial
weights; psi0 is drawn by the trainer (batch 1). The episode number is the benchmark's, made odd
where it is a multiple of ten, at which the stock episode empties the CUDA cache.
"""

import contextlib
import copy
import functools
import time
import unittest.mock

import numpy
import torch

import common
import qca_lowmem
from qca_lowmem import StepGraph
from qca_lowmem.atheria import captures
from qca_lowmem.examples import QC_Trainer_v4, make_config

TRAINER_RUNS = ["stock_v4", "lowmem_enable_default", "lowmem_enable_channels_last", "lowmem_enable_nchw"]
OVERLAP_TRAINER_RUNS = ["lowmem_enable_default_overlap"]  # by name
_CHANNELS_LAST = {"lowmem_enable_channels_last": True, "lowmem_enable_nchw": False}  # the default: unset


class TrainerRun:
    """A trainer run with Run's interface: warmed up by one episode, then episode(seed) -> seconds."""

    def __init__(self, name, stock_model, args, device):
        self.name, self.args, self.device = name, args, device
        on_cuda = device.type == "cuda"
        config = make_config(grid=args.grid, d_state=args.d_state, hidden=args.hidden, qca_steps=args.steps,
                             gamma=args.gamma)
        self.trainer = QC_Trainer_v4(config, device=device, max_noise=args.max_noise, use_amp=on_cuda,
                                     scaler=torch.amp.GradScaler("cuda") if on_cuda else None,
                                     operator=copy.deepcopy(stock_model))
        if name.startswith("lowmem_enable"):
            qca_lowmem.enable(self.trainer, channels_last=_CHANNELS_LAST.get(name))
        self.episode_number = args.episode + (args.episode % 10 == 0)
        self.episode(seed=0)

    def episode(self, seed):
        torch.manual_seed(seed)
        numpy.random.seed(seed)  # the bit flip's coin
        common.synchronize(self.device)
        start = time.perf_counter()
        with self._step_graphs():
            self.trainer.train_episode(self.episode_number)
        common.synchronize(self.device)
        return time.perf_counter() - start

    def _step_graphs(self):
        """The StepGraph the switch makes for this run's episodes: two lanes for an _overlap run."""
        if self.name not in OVERLAP_TRAINER_RUNS:
            return contextlib.nullcontext()
        return unittest.mock.patch.object(captures, "StepGraph", functools.partial(StepGraph, overlap=True))

    @contextlib.contextmanager
    def steps_set(self, steps):
        saved, self.trainer.qca_steps = self.trainer.qca_steps, steps
        try:
            yield
        finally:
            self.trainer.qca_steps = saved

    def capture_record(self):
        state = getattr(self.trainer, "_qca_lowmem_state", None)
        graph = None if state is None else state.captures.step_graph
        if graph is None:
            return {"cuda_graph": state.options.cuda_graph} if state is not None else {}
        return {"cuda_graph": True, "captures_made": graph.captures_made, "fell_back": bool(graph.failed_keys)}

    def release(self):
        del self.trainer
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
