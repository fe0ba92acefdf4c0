"""Composer's learning-rate schedulers and decoupled-weight-decay optimizers, for optax.

Schedulers (``CosineAnnealingWithWarmupScheduler(t_warmup='0.1dur')``...) give a learning-rate
multiplier, on the host from a ``State`` (Composer's API) and inside the train step from the
optimizer's step count (:func:`compile_schedulers`, :func:`with_schedule`). ``DecoupledAdamW`` and
``DecoupledSGDW`` are Composer's optimizers as optax transformations whose learning rate is visible
in their state.

Example:
    >>> import jax.numpy as jnp
    >>> from composerjax.optim import DecoupledAdamW, LinearWithWarmupScheduler, ScheduleContext
    >>> from composerjax.optim import compile_schedulers, with_schedule
    >>> context = ScheduleContext(max_duration='100ba')
    >>> multiplier = compile_schedulers([LinearWithWarmupScheduler(t_warmup='10ba')], context)
    >>> optimizer = with_schedule(DecoupledAdamW(lr=1e-3), multiplier)
    >>> [round(float(multiplier(jnp.int32(step))), 3) for step in (0, 5, 10, 55, 100)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
"""

from composerjax.optim.compiled_schedule import ScheduleState, compile_schedulers, learning_rate_states, with_schedule
from composerjax.optim.decoupled_weight_decay import DecoupledAdamW, DecoupledSGDW
from composerjax.optim.optimizer_names import name_optimizer, optimizer_name
from composerjax.optim.schedule_time import ScheduleContext, convert_time, scale_max_duration
from composerjax.optim.scheduler import (
    ComposerScheduler,
    ConstantScheduler,
    CosineAnnealingScheduler,
    CosineAnnealingWarmRestartsScheduler,
    ExponentialScheduler,
    LinearScheduler,
    MultiStepScheduler,
    PolynomialScheduler,
    StepScheduler,
)
from composerjax.optim.warmup_scheduler import (
    ConstantWithWarmupScheduler,
    CosineAnnealingWithWarmupScheduler,
    LinearWithWarmupScheduler,
    MultiStepWithWarmupScheduler,
    PolynomialWithWarmupScheduler,
)

__all__ = [
    "ComposerScheduler",
    "ConstantScheduler",
    "ConstantWithWarmupScheduler",
    "CosineAnnealingScheduler",
    "CosineAnnealingWarmRestartsScheduler",
    "CosineAnnealingWithWarmupScheduler",
    "DecoupledAdamW",
    "DecoupledSGDW",
    "ExponentialScheduler",
    "LinearScheduler",
    "LinearWithWarmupScheduler",
    "MultiStepScheduler",
    "MultiStepWithWarmupScheduler",
    "PolynomialScheduler",
    "PolynomialWithWarmupScheduler",
    "ScheduleContext",
    "ScheduleState",
    "StepScheduler",
    "compile_schedulers",
    "convert_time",
    "learning_rate_states",
    "name_optimizer",
    "optimizer_name",
    "scale_max_duration",
    "with_schedule",
]
