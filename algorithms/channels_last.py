"""ChannelsLast: Composer's switch to NHWC memory format, a no-op here because XLA chooses layouts.

Composer converts a PyTorch model's weights and activations to ``torch.channels_last`` so cuDNN
can pick faster NHWC convolution kernels. In JAX the question does not arise: flax convolutions
take ``(N, H, W, C)`` arrays already, and XLA decides the physical layout of every array in the
compiled step for the device at hand (on GPU it already prefers NHWC for convolutions). The
algorithm is kept so Composer recipes and code that name it run unchanged; it changes nothing and
says so once, at ``Event.INIT``.
"""

from __future__ import annotations

import warnings

from flax import nnx

from composerjax import Algorithm, Event, Logger, State

__all__ = ["ChannelsLast", "apply_channels_last"]

MESSAGE = ("ChannelsLast has no effect in composerjax: flax convolutions already take NHWC (channels-last) "
           "arrays and XLA chooses each array's memory layout when it compiles the step, so there is no "
           "memory format to convert")


def apply_channels_last(model: nnx.Module) -> None:
    """Composer's functional form; leaves ``model`` as it is (XLA picks memory layouts).

    Example:
        >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        >>> apply_channels_last(model) is None
        True
    """
    del model


class ChannelsLast(Algorithm):
    """Accept Composer's ``ChannelsLast()`` and warn once at ``INIT`` that XLA already chooses layouts.

    Takes no arguments, like Composer's. Runs only at ``Event.INIT`` (host); the model, its
    parameters and the compiled step are left exactly as they were.

    Example::

        trainer = Trainer(ComposerClassifier(SmallResNet(rngs=nnx.Rngs(0)), 10), loader, '1ep',
                          algorithms=[ChannelsLast()])
    """

    events = frozenset({Event.INIT})

    def __init__(self) -> None:
        pass

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        apply_channels_last(state.model)
        warnings.warn(MESSAGE, UserWarning, stacklevel=2)

    def __repr__(self) -> str:
        return "ChannelsLast()"
