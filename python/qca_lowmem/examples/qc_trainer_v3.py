"""A stand-in for the users' QC_Trainer_v3 (Jonakss/Atheria), the trainer their command-line
pipeline resumes old experiments on, written to the attributes `qca_lowmem.enable` relies on
(docs/design.md): the switch's tests (tests/atheria/) train it.

Its episode, as theirs: psi0 = `motor.get_initial_state(batch_size)` (batch 4 by default), the
stock engine step `qca_steps` times, the reward on (psi0, psi_T), loss = -reward, gradient
clipping at `gradient_clip` when positive, Adam, and the engine's ConvLSTM memory dropped after
the episode. `motor.compile_model()` wraps the operator in torch.compile, as their engine does.
Nothing here uses qca_lowmem's kernels.
"""

import torch

from qca_lowmem.examples.qc_trainer_v4 import MemoryMotor, Motor, QuantumState
from qca_lowmem.stock import UNetUnitary


class EngineV3:
    """What V3 asks of its engine besides the step: a batch of initial states, the compile
    switch, and the model whose parameters train (the compiled module's own)."""

    def get_initial_state(self, batch_size):
        shape = (batch_size, self.cfg.GRID_SIZE_TRAINING, self.cfg.GRID_SIZE_TRAINING, self.cfg.D_STATE)
        real = torch.float64 if self.cfg.DTYPE == torch.complex128 else torch.float32
        psi = torch.complex(torch.randn(shape, dtype=real), torch.randn(shape, dtype=real)).to(self.state.device)
        return psi / (torch.sqrt(torch.sum(psi.abs().pow(2), dim=-1, keepdim=True)) + 1e-9)

    def compile_model(self):
        self.operator = torch.compile(self.operator)

    def get_model_for_params(self):
        return getattr(self.operator, "_orig_mod", self.operator)


class MotorV3(EngineV3, Motor):
    pass


class MemoryMotorV3(EngineV3, MemoryMotor):
    pass


class QC_Trainer_v3:
    def __init__(self, cfg, device="cpu", operator=None, memory=False, batch_size=4, gradient_clip=1.0,
                 compile_operator=False, lr=1e-3):
        """operator: the model (default the stock UNetUnitary); memory: the engine runs it with
        memory (h, c on motor.state); compile_operator: motor.compile_model() before the optimizer."""
        device = torch.device(device)
        if operator is None:
            operator = UNetUnitary(cfg.D_STATE, cfg.HIDDEN_CHANNELS)
        engine = MemoryMotorV3 if memory else MotorV3
        self.motor = engine(operator.to(device), cfg, QuantumState(cfg, device))
        if compile_operator:
            self.motor.compile_model()
        self.optimizer = torch.optim.Adam(self.motor.get_model_for_params().parameters(), lr=lr)
        self.qca_steps = cfg.QCA_STEPS_TRAINING
        self.batch_size = batch_size
        self.gradient_clip = gradient_clip
        self.peso_quietud = 10.0
        self.peso_complejidad = 1.0

    def compute_reward(self, psi_initial, psi_final):
        delta_norm = torch.mean(torch.abs(psi_final - psi_initial))
        reward_quietud = -self.peso_quietud * delta_norm
        spatial_var = torch.var(psi_final.abs().flatten(start_dim=1), dim=1)
        reward_complejidad = -self.peso_complejidad * torch.abs(spatial_var - 0.1).mean()
        return reward_quietud + reward_complejidad, reward_quietud, reward_complejidad

    def train_episode(self, episode):
        self.motor.get_model_for_params().train()
        self.optimizer.zero_grad()
        psi_initial = self.motor.get_initial_state(self.batch_size)
        psi_initial.requires_grad_(True)
        psi_final = psi_initial
        for _ in range(self.qca_steps):
            psi_final = self.motor.evolve_step(psi_final)
        for name in ("h_state", "c_state"):
            if getattr(self.motor.state, name, None) is not None:
                setattr(self.motor.state, name, None)
        total, quietud, complejidad = self.compute_reward(psi_initial, psi_final)
        loss = -total
        loss.backward()
        if self.gradient_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.motor.get_model_for_params().parameters(), self.gradient_clip)
        self.optimizer.step()
        return loss.item(), total.item(), quietud.item(), complejidad.item()
