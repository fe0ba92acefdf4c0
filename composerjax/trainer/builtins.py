"""The Trainer's built-in callbacks, from its sections: checkpoint saving, the time limit, the signal exit."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from composerjax.checkpoint.saver import CheckpointSaver
from composerjax.checkpoint.settings import CheckpointSettings
from composerjax.core.engine import Engine
from composerjax.core.state import State
from composerjax.trainer.interrupt import StopControl
from composerjax.trainer.stopping import SignalHandler, TimeLimit

__all__ = ["install_builtins"]


def install_builtins(state: State, engine: Engine, checkpoint: CheckpointSettings, control: StopControl, *,
                     time_limit: float | None, handle_signals: bool, hparams: Callable[[], dict[str, Any]],
                     close: Callable[[], None]) -> CheckpointSaver | None:
    """Append the built-ins the sections ask for (unless the user passed their own), then bind every one.

    Each built-in gets only what it acts on: the saver its section's folder and the run's name and
    hparams, the stoppers the run's :class:`StopControl` (and the signal exit the saver and
    ``close``). Plugins that read the engine (its trace log) get ``attach(engine)``. Returns the
    checkpoint saver (None without one).

    Example::

        saver = install_builtins(state, engine, settings.checkpoint, control, time_limit=None,
                                 handle_signals=True, hparams=lambda: {}, close=trainer.close)
    """
    callbacks = state.callbacks
    given = {type(c) for c in callbacks}
    if checkpoint.save_folder is not None:
        if CheckpointSaver in given:
            raise ValueError(f"save_folder={os.fspath(checkpoint.save_folder)!r} and a CheckpointSaver in callbacks: "
                             "give one")
        callbacks.append(CheckpointSaver.from_settings(checkpoint))
    if time_limit is not None and TimeLimit not in given:
        callbacks.append(TimeLimit(time_limit))
    if handle_signals and SignalHandler not in given:
        callbacks.append(SignalHandler())
    if any(isinstance(c, SignalHandler) for c in callbacks):  # the signal exit closes the trainer: last
        callbacks.sort(key=lambda c: isinstance(c, SignalHandler))
    saver = next((c for c in callbacks if isinstance(c, CheckpointSaver)), None)
    for plugin in callbacks:
        if isinstance(plugin, CheckpointSaver):
            plugin.open(state.timestamp, state.run_name, hparams)
        elif isinstance(plugin, TimeLimit):
            plugin.bind(control)
        elif isinstance(plugin, SignalHandler):
            plugin.bind(control, saver, close)
    for plugin in (*callbacks, *getattr(engine.logger, "destinations", ())):
        attach = getattr(plugin, "attach", None)  # plugins that read the engine itself (its trace log)
        if callable(attach):
            attach(engine)
    return saver
