"""The two ways an episode stops before it draws, calls or trains anything, each a RuntimeError
whose message says what to do, for the switch to act on: a value enable() read once and proved the
episode at has changed since (enable() runs again, reading it anew), or what the episode cannot run
as stock would now (under `QCA_LOWMEM=1` alone, the trainer then trains on stock)."""


class ProofStale(RuntimeError):
    """What enable() read once and proved the episode at changed since: the grid, d_state, use_amp,
    the engine's memory. `changed`: that, in a few words, without the advice."""

    def __init__(self, message: str, changed: str):
        super().__init__(message)
        self.changed = changed


class EpisodeRefused(RuntimeError):
    """What the episode cannot run as stock's would, in the caller's context (an autocast, a mode)
    or on the engine as it is now (a compiled layer on its own step, an engine put back to stock or
    set after enable(), which another trainer may hold enabled)."""
