"""Gyro dropout (Park et al., 2022): train a fixed, small set of dropout subnetworks instead of fresh ones.

Each :class:`GyroDropout` layer has ``sigma`` pre-selected dropout masks over its features. Every
``period`` training calls it picks ``tau`` of them (with replacement); the batch is cut into ``tau``
equal consecutive slices and slice ``i`` uses the ``i``-th picked mask, so each mask is trained on
many batches. Kept features are scaled by ``1 / (1 - p)``; evaluation is the identity. As in
Composer: ``period = int(total_steps / sigma) * tau``, where Composer's ``total_steps`` is
``iters_per_epoch * max_epoch``.

Everything random comes from one key per layer, held in its ``nnx.Rngs`` (``rngs.dropout``): mask
``j`` is ``bernoulli(fold_in(mask_key, j), 1 - p)`` and the picks of selection ``r`` are
``randint(fold_in(pick_key, r), (tau,), 0, sigma)``, so the masks need no storage and a resumed run
draws exactly what the uninterrupted one would.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from composerjax import Algorithm, Event, Logger, State
from composerjax.models.surgery import replace_modules

__all__ = [
    "GyroDropout",
    "GyroDropoutLayer",
    "GyroDropoutPeriod",
    "GyroDropoutStep",
    "apply_gyro_dropout",
    "gyro_selection_period",
    "set_selection_period",
]


def gyro_selection_period(total_steps: int, sigma: int, tau: int) -> int:
    """Training calls between two mask selections: ``int(total_steps / sigma) * tau`` (Composer's ``iter_num``).

    Raises:
        ValueError: ``total_steps < sigma`` (the period would be 0; Composer divides by it).

    Example:
        >>> gyro_selection_period(total_steps=100 * 10, sigma=256, tau=16)
        48
    """
    period = int(total_steps / sigma) * tau
    if period <= 0:
        raise ValueError(f"GyroDropout(sigma={sigma}): training has {total_steps} steps, fewer than sigma, so no "
                         "mask would be selected more than once; lower sigma or train longer")
    return period


class GyroDropoutStep(nnx.Variable):
    """Training calls of a :class:`GyroDropoutLayer` so far (Composer's ``training_step``)."""


class GyroDropoutPeriod(nnx.Variable):
    """Training calls between mask selections of a :class:`GyroDropoutLayer` (Composer's ``iter_num``)."""


class GyroDropoutLayer(nnx.Module):
    """Dropout with ``sigma`` fixed masks over the last axis, ``tau`` of them in use at a time.

    ``model.train()`` / ``model.eval()`` set ``deterministic`` as they do for ``nnx.Dropout``; the
    call takes ``deterministic=`` like ``nnx.Dropout`` too (and ignores ``rngs=``).

    Args:
        p: the drop probability of each feature in a mask, in ``[0, 1)``.
        sigma: the number of pre-selected masks.
        tau: the number of masks used at once; the batch must divide into ``tau`` slices.
        period: training calls between selections.
        rngs: the layer's key, read (never advanced) from its ``dropout`` stream.

    Example:
        >>> layer = GyroDropoutLayer(0.5, sigma=4, tau=2, period=1, rngs=nnx.Rngs(dropout=0))
        >>> out = layer(jnp.ones((4, 6)))
        >>> bool(jnp.all((out == 0) | (out == 2))), bool(jnp.all(out[0] == out[1]))
        (True, True)
    """

    def __init__(self, p: float = 0.5, sigma: int = 256, tau: int = 16, period: int = 1, *, rngs: nnx.Rngs,
                 deterministic: bool | None = False) -> None:
        _check_arguments(p, sigma, tau)
        self.p = float(p)
        self.sigma = sigma
        self.tau = tau
        self.period = GyroDropoutPeriod(jnp.asarray(period, jnp.int32))
        self.step = GyroDropoutStep(jnp.zeros([], jnp.int32))
        self.rngs = rngs
        self.deterministic = deterministic

    def masks(self, selection: jax.Array, features: int) -> jax.Array:
        """The ``(tau, features)`` keep masks (0/1) of selection ``selection``, in batch-slice order."""
        key = self.rngs.dropout.key[...]
        mask_key, pick_key = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
        picked = jax.random.randint(jax.random.fold_in(pick_key, selection), (self.tau,), 0, self.sigma)
        draw = lambda index: jax.random.bernoulli(jax.random.fold_in(mask_key, index), 1 - self.p, (features,))  # noqa: E731
        return jax.vmap(draw)(picked)

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None, rngs: nnx.Rngs | None = None) -> jax.Array:
        deterministic = self.deterministic if deterministic is None else deterministic
        if deterministic is None:
            raise ValueError("GyroDropoutLayer: deterministic is None; set it on the layer (model.train() / "
                             "model.eval()) or pass deterministic= to the call")
        if deterministic:
            return x
        batch = x.shape[0]
        if batch % self.tau:
            raise ValueError(f"GyroDropout(tau={self.tau}): the batch of {batch} samples does not split into tau "
                             "equal slices; use a (micro)batch size that is a multiple of tau")
        step = self.step[...]
        masks = self.masks(step // self.period[...], x.shape[-1])
        mask = jnp.repeat(masks, batch // self.tau, axis=0).reshape((batch,) + (1,) * (x.ndim - 2) + (x.shape[-1],))
        self.step[...] = step + 1
        return x * mask.astype(x.dtype) * jnp.asarray(1 / (1 - self.p), x.dtype)


def apply_gyro_dropout(model: nnx.Module, p: float = 0.5, sigma: int = 256, tau: int = 16, period: int = 1,
                       seed: int | jax.Array = 0) -> int:
    """Replace every ``nnx.Dropout`` in ``model`` with a :class:`GyroDropoutLayer`; return how many.

    The new layers use ``p`` (not the old layer's rate, as in Composer) and keep the old layer's
    ``deterministic``. Layer ``l`` (in definition order) gets the key ``fold_in(seed, l)``.

    Example:
        >>> model = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Dropout(0.1))
        >>> apply_gyro_dropout(model, p=0.5, sigma=8, tau=2)
        1
        >>> type(model.layers[1]).__name__, model.layers[1].p
        ('GyroDropoutLayer', 0.5)
    """
    _check_arguments(p, sigma, tau)
    key = jax.random.key(seed) if isinstance(seed, int) else seed

    def replace(dropout: nnx.Dropout, index: int) -> GyroDropoutLayer:
        rngs = nnx.Rngs(dropout=jax.random.fold_in(key, index))
        return GyroDropoutLayer(p, sigma, tau, period, rngs=rngs, deterministic=dropout.deterministic)

    return replace_modules(model, {nnx.Dropout: replace})


def set_selection_period(model: nnx.Module, period: int) -> int:
    """Set the selection period of every :class:`GyroDropoutLayer` in ``model``; return how many."""
    layers = [module for _, module in nnx.iter_modules(model) if isinstance(module, GyroDropoutLayer)]
    for layer in layers:
        layer.period[...] = jnp.asarray(period, jnp.int32)
    return len(layers)


class GyroDropout(Algorithm):
    """Replace ``nnx.Dropout`` layers with :class:`GyroDropoutLayer` (surgery at ``INIT``).

    Events: ``INIT`` (host) replaces the layers; ``FIT_START`` (host) sets their selection period to
    ``int(total_steps / sigma) * tau`` from the run's length in batches (Composer's
    ``iters_per_epoch * max_epoch``), through ``state.update_model()``.

    Args:
        p: the drop probability, in ``[0, 1)``. Default: ``0.5``.
        sigma: the number of pre-selected subnetworks (masks) per layer. Default: ``256``.
        tau: the number of subnetworks trained at once; the batch is split into ``tau`` slices, so
            the (micro)batch size must be a multiple of it. Default: ``16``.
        seed: the layers' keys; ``None`` derives them from the trainer's ``seed``.

    Example::

        trainer = Trainer(ComposerClassifier(SmallCNN(rngs=nnx.Rngs(0)), 10), loader, '100ep',
                          algorithms=[GyroDropout(p=0.5, sigma=256, tau=16)])
    """

    def __init__(self, p: float = 0.5, sigma: int = 256, tau: int = 16, seed: int | None = None) -> None:
        _check_arguments(p, sigma, tau)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed={seed!r}: expected an integer or None (derive it from the trainer's seed)")
        self.p = float(p)
        self.sigma = sigma
        self.tau = tau
        self.seed = seed
        self.num_replaced = 0

    events = frozenset({Event.INIT, Event.FIT_START})

    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT or (event == Event.FIT_START and self.num_replaced > 0)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            seed = jax.random.key(self.seed) if self.seed is not None else jax.random.fold_in(state.rng, 0x6790)
            self.num_replaced = apply_gyro_dropout(state.model, self.p, self.sigma, self.tau, 1, seed)
            logger.log_hyperparameters({"gyro_dropout/num_replaced": self.num_replaced})
            if self.num_replaced == 0:
                warnings.warn("GyroDropout replaced no modules: the model has no nnx.Dropout", stacklevel=2)
            return
        total_steps = state.batches_in_duration()
        if total_steps is None:
            raise ValueError(f"GyroDropout needs the run's length in batches to set its selection period: "
                             f"max_duration={state.max_duration} is not in 'ba', or in 'ep' / 'sp' with a "
                             "dataloader of known length")
        period = gyro_selection_period(total_steps, self.sigma, self.tau)
        set_selection_period(state.model, period)
        state.update_model()
        logger.log_hyperparameters({"gyro_dropout/selection_period": period})

    def __repr__(self) -> str:
        return f"GyroDropout(p={self.p}, sigma={self.sigma}, tau={self.tau})"


def _check_arguments(p: float, sigma: int, tau: int) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"p={p!r}: expected a drop probability in [0, 1)")
    if isinstance(sigma, bool) or not isinstance(sigma, int) or sigma < 1:
        raise ValueError(f"sigma={sigma!r}: expected a positive integer (the number of pre-selected masks)")
    if isinstance(tau, bool) or not isinstance(tau, int) or tau < 1:
        raise ValueError(f"tau={tau!r}: expected a positive integer (the masks used at once)")
