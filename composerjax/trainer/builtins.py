"""The Trainer's built-in callbacks, from its arguments: checkpoint saving, the time limit, the signal exit."""

from __future__ import annotations

import os
from typing import Any

from composerjax.checkpoint.saver import CheckpointSaver
from composerjax.trainer.stopping import SignalHandler, TimeLimit

__all__ = ["install_builtins"]


def install_builtins(trainer: Any, save_folder: Any) -> Any:
    """Append the built-ins the arguments ask for (unless the user passed their own), then attach every plugin.

    Returns the checkpoint saver's checkpointer (None without one); ``trainer.checkpointer`` is the
    saver while plugins attach. Example: ``trainer.checkpointer = install_builtins(trainer, save_folder)``.
    """
    callbacks = trainer.state.callbacks
    given = {type(c) for c in callbacks}
    if save_folder is not None:
        if CheckpointSaver in given:
            raise ValueError(f"save_folder={os.fspath(save_folder)!r} and a CheckpointSaver in callbacks: give one")
        callbacks.append(CheckpointSaver.from_arguments(trainer.arguments))
    if trainer.time_limit is not None and TimeLimit not in given:
        callbacks.append(TimeLimit(trainer.time_limit))
    if trainer.handle_signals and SignalHandler not in given:
        callbacks.append(SignalHandler())
    if any(isinstance(c, SignalHandler) for c in callbacks):  # the signal exit closes the trainer: last
        callbacks.sort(key=lambda c: isinstance(c, SignalHandler))
    trainer.checkpointer = saver = next((c for c in callbacks if isinstance(c, CheckpointSaver)), None)
    for plugin in (*callbacks, *trainer.logger.destinations):
        attach = getattr(plugin, "attach_trainer", None)
        if callable(attach):
            attach(trainer)
        attach = getattr(plugin, "attach", None)  # plugins that read the engine itself (its trace log)
        if callable(attach):
            attach(trainer.engine)
    return saver.checkpointer if saver is not None else None
