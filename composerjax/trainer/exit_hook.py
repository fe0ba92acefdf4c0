"""Close the Trainers still open when the interpreter exits, so trackers keep what they were given.

A script that ends after ``trainer.fit()`` without ``trainer.close()`` would otherwise leave MLflow's
background writer holding unsent metrics, the W&B run unfinished and event files unclosed. Every
Trainer is registered here when it is built (weakly: a Trainer nobody holds is still garbage
collected) and forgotten when it is closed; at exit the ones left are closed, newest first.

The hook runs at the very start of interpreter shutdown, before ``concurrent.futures`` stops its
thread pools: an ``atexit`` callback would be too late, since by then MLflow's writer can no longer
schedule its last batches ("cannot schedule new futures after interpreter shutdown"), whatever
order the ``atexit`` callbacks run in.

Example::

    trainer = Trainer(model, loader, max_duration="2ep", loggers=[MLFlowLogger()])
    trainer.fit()
    # no trainer.close(): at exit, close_open_trainers() flushes the metrics and ends the MLflow run
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  its shutdown hook must be registered before ours (they run LIFO)
import itertools
import sys
import threading
import traceback
import weakref
from typing import Any, Protocol


class Closeable(Protocol):
    """What the exit hook closes: a Trainer (anything with ``close()``)."""

    def close(self) -> None: ...

__all__ = ["close_open_trainers", "forget", "open_trainers", "register"]

_open: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_order = itertools.count()
_installed = False


def register(trainer: Closeable) -> None:
    """Close ``trainer`` at interpreter exit unless it is closed (or garbage collected) before."""
    _install()
    _open[next(_order)] = trainer


def forget(trainer: Closeable) -> None:
    """``trainer`` was closed: nothing left to do for it at exit."""
    for key, registered in list(_open.items()):
        if registered is trainer:
            del _open[key]


def open_trainers() -> list[Any]:
    """The registered Trainers not closed yet, oldest first.

    Example::

        trainer = Trainer(model, loader, max_duration="1ep")
        assert trainer in open_trainers()   # until trainer.close()
    """
    alive = [(key, _open.get(key)) for key in list(_open.keys())]  # one may be collected meanwhile
    return [trainer for _, trainer in sorted(alive, key=lambda pair: pair[0]) if trainer is not None]


def close_open_trainers() -> None:
    """Close every Trainer still open, newest first; an error closing one is printed and the next is closed."""
    for trainer in reversed(open_trainers()):
        try:
            trainer.close()
        except Exception:  # the others must still be closed
            print(f"composerjax: closing {type(trainer).__name__} {getattr(trainer.state, 'run_name', '')!r} "
                  "at exit failed:", file=sys.stderr)
            traceback.print_exc()
        forget(trainer)


def _install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    # threading's shutdown hooks run when the main thread ends, before concurrent.futures refuses new
    # work and before any atexit callback (mlflow's, wandb's, jax's). It is private API, present since
    # Python 3.9; atexit is the fallback, which cannot save MLflow's queue but still ends the runs.
    register_early = getattr(threading, "_register_atexit", None)
    try:
        if register_early is None:
            raise RuntimeError("threading._register_atexit is not available")
        register_early(close_open_trainers)
    except RuntimeError:  # not available, or the interpreter is already shutting down
        atexit.register(close_open_trainers)
