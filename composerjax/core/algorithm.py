"""The Algorithm base class: a small, composable change to how a model trains."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import jax

from composerjax.core.event import Event

if TYPE_CHECKING:
    from composerjax.core.logger import Logger
    from composerjax.core.state import State

__all__ = ["Algorithm"]


class Algorithm:
    """Base class for algorithms: ``match`` says when to run, ``apply`` changes the state in place.

    The same two methods serve host events (concrete values, any Python) and traced events (inside
    the compiled step: ``state.batch``, ``state.outputs``, ``state.loss``, ``state.grads``,
    ``state.step``, ``state.progress``, ``state.step_rng`` and this algorithm's own device state are
    tracers, so ``apply`` must be traceable). ``match`` always runs on the host, once per batch for
    traced events: the set of algorithms that matched is the key of the compiled step.

    Class attributes read by the default passes (the core never imports a concrete algorithm):

    * ``run_first`` / ``run_last``: sort this algorithm before / after the others. ``set_filo_order``
      then reverses every ``AFTER_*`` event, so there a ``run_first`` algorithm runs last: it is the
      outermost wrapper, first in and last out (as in Composer).
    * ``interpolates_loss``: this algorithm mixes losses (MixUp, CutMix); more than one warns.

    Read by ``composerjax explain``: ``required_modules``, the module classes (any of them) the
    algorithm acts on; a model with none of them is reported as a conflict.

    Read by the engine: ``events``, the only events at which ``match`` can return True (``None``,
    the default: any event). The engine then never asks ``match`` about the others, which keeps the
    per-batch host cost to a few calls however many events a batch has. A declaration that leaves
    out an event ``match`` accepts is a bug: at INIT the engine asks ``match`` about the other
    events once and warns (``UndeclaredEventWarning``); ``COMPOSERJAX_CHECK_EVENTS=1`` makes that
    an error and checks every event of the run too, ``=0`` turns it off.
    The default ``match`` returns ``event in self.events``: an algorithm that runs at every event
    it declares needs no ``match`` of its own; override it to add conditions (a schedule, a flag).

    Example:
        >>> import jax.numpy as jnp
        >>> class ScaleLoss(Algorithm):
        ...     events = frozenset({Event.AFTER_LOSS})
        ...     def __init__(self, factor: float) -> None:
        ...         self.factor = factor
        ...     def apply(self, event, state, logger):
        ...         state.loss = state.loss * self.factor
        >>> ScaleLoss(2.0).name, ScaleLoss(2.0).match(Event.AFTER_LOSS, None)
        ('ScaleLoss', True)
    """

    run_first: bool = False
    run_last: bool = False
    interpolates_loss: bool = False
    required_modules: tuple[type, ...] = ()
    events: frozenset[Event] | None = None

    @property
    def name(self) -> str:
        """The key of this algorithm's device state in ``state.algorithm_state``.

        The class name, with ``#k`` for the k-th repeat of a class in one trainer.
        """
        return getattr(self, "_state_key", type(self).__name__)

    @name.setter
    def name(self, value: str) -> None:
        """Set by the step runner when it builds the device state (``#k`` for the k-th repeat of a class)."""
        self._state_key = value

    def sample_key(self, step_rng: jax.Array) -> jax.Array:
        """The key this algorithm draws from in a step: ``step_rng`` folded with a hash of its name.

        Two algorithms in one step (MixUp and CutOut, say) thus never reuse the same random numbers.
        """
        return jax.random.fold_in(step_rng, zlib.crc32(self.name.encode()))

    def match(self, event: Event, state: State) -> bool:
        """Return whether ``apply`` should run at ``event``. Runs on the host.

        The default: ``event in self.events``. An algorithm that declares no ``events`` must
        override it (it is then asked at every event).

        Raises:
            NotImplementedError: ``events`` is None and the subclass does not override ``match``.

        Example:
            >>> class AtInit(Algorithm):
            ...     events = frozenset({Event.INIT})
            >>> AtInit().match(Event.INIT, None), AtInit().match(Event.FIT_END, None)
            (True, False)
        """
        if self.events is None:
            raise NotImplementedError(f"{type(self).__name__} must implement match(event, state), or declare "
                                      "`events` to run at each of them")
        return event in self.events

    def apply(self, event: Event, state: State, logger: Logger) -> int | None:
        """Change ``state`` in place; return an optional exit code recorded in the trace."""
        raise NotImplementedError(f"{type(self).__name__} must implement apply(event, state, logger)")

    def init_state(self, state: State) -> Any:
        """Return this algorithm's device state (a pytree of arrays), or ``None`` if it keeps none.

        The engine stores it in ``state.algorithm_state[self.name]``, carries it through every
        compiled step (donated, sharded like the parameters) and checkpoints it.
        """
        return None

    def state_dict(self) -> dict[str, Any]:
        """Host-side state to checkpoint (device state goes through ``init_state`` instead)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
