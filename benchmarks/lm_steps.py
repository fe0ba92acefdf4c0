"""The pieces of ``benchmarks/lm.py``: the LM job, its two training loops, and what XLA says about their step.

A :class:`Job` fixes the model, the batch shape and the optimizer: Composer's LLM recipe
(``DecoupledAdamW``, betas 0.9 / 0.95, ``CosineAnnealingWithWarmupScheduler`` and
``GradientClipping('norm', 1.0)``, as llm-foundry's GPT configs use). :func:`engine_trainer`
builds it with the library; :class:`HandStep` is the strongest hand-written JAX equivalent:
parameters as plain dicts, numpy batches straight into one donated ``jax.jit`` step, and optax's
``adamw`` with the same schedule after ``clip_by_global_norm`` (the same update: optax's
``weight_decay`` is Composer's divided by the peak rate). Both compute the loss as GPT-2's training
does, over the vocabulary in chunks (:func:`~composerjax.models.lm_loss.cross_entropy_loss`);
``HandStep(whole_logits=True)`` is the step before that, on the whole batch's logits.
:func:`step_costs` reads the FLOPs and peak memory of a compiled step; :func:`peak_flops` is the
accelerator's dense bf16 peak.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from composerjax import Trainer
from composerjax.algorithms import GradientClipping
from composerjax.models.causal_lm import ComposerCausalLM
from composerjax.models.composer_model import cross_entropy
from composerjax.models.gpt2 import GPT2, GPT2Config, flops_per_token
from composerjax.models.lm_loss import cross_entropy_loss
from composerjax.optim import CosineAnnealingWithWarmupScheduler, DecoupledAdamW

#: Dense bfloat16 tensor-core peak FLOP/s (no sparsity), matched in order against ``device.device_kind``.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989e12),  # also GH200
    ("A100", 312e12),
)

PRECISIONS = ("fp32", "amp_bf16", "bf16")


def peak_flops(device: Any) -> float | None:
    """The dense bf16 peak of ``device`` from :data:`PEAK_BF16_FLOPS`; None off GPU or for an unlisted GPU."""
    if device.platform != "gpu":
        return None
    kind = device.device_kind.lower()
    return next((peak for name, peak in PEAK_BF16_FLOPS if name.lower() in kind), None)


@dataclass(frozen=True)
class Job:
    """One language-model training job: model, batch shape, optimizer and schedule (Composer's LLM defaults)."""

    config: GPT2Config
    seq_len: int
    batch_size: int
    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 1e-5  # DecoupledAdamW's: per step at the peak rate, not scaled by it
    warmup_fraction: float = 0.1
    alpha_f: float = 0.1
    clip: float = 1.0

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size

    @property
    def model_flops_per_step(self) -> float:
        """``6N + 12·L·H·Q·T`` per token (:func:`~composerjax.models.gpt2.flops_per_token`) times the batch's tokens."""
        return float(flops_per_token(self.config, self.seq_len)) * self.tokens_per_step

    def warmup_steps(self, total: int) -> int:
        return max(1, round(self.warmup_fraction * total))

    def describe(self) -> str:
        c = self.config
        return (f"GPT-2 d{c.n_embd} L{c.n_layer} H{c.n_head} vocab {c.vocab_size} ({c.padded_vocab_size} rows), "
                f"remat {c.remat}{', scanned layers' if c.scan_layers else ''}, seq {self.seq_len}, batch "
                f"{self.batch_size}; DecoupledAdamW lr {self.lr:g} betas {self.betas} wd {self.weight_decay:g}, "
                f"cosine with {self.warmup_fraction:.0%} warmup to {self.alpha_f:g}, clip norm {self.clip:g}")


def engine_trainer(job: Job, train: Any, total_steps: int, precision: str, seed: int,
                   algorithms: Sequence[Any] = (), **options: Any) -> Trainer:
    """The job through ``Trainer``: GPT-2 as ``factories.gpt2`` builds it, Composer's optimizer and schedule."""
    model = ComposerCausalLM(GPT2(job.config, rngs=nnx.Rngs(seed)))
    return Trainer(
        model, train, max_duration=f"{total_steps}ba",
        optimizers=DecoupledAdamW(lr=job.lr, betas=job.betas, eps=job.eps, weight_decay=job.weight_decay),
        schedulers=CosineAnnealingWithWarmupScheduler(t_warmup=f"{job.warmup_steps(total_steps)}ba",
                                                      alpha_f=job.alpha_f),
        algorithms=[GradientClipping("norm", job.clip), *algorithms], precision=precision, seed=seed,
        progress_bar=False, run_summary=False, tokens_per_batch=lambda batch: int(np.size(batch[0])), **options)


def hand_optimizer(job: Job, total_steps: int) -> optax.GradientTransformation:
    """optax's clip + adamw with the schedule and update of :func:`engine_trainer`'s optimizer."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, job.lr, job.warmup_steps(total_steps), total_steps,
                                                  end_value=job.lr * job.alpha_f)
    adamw = optax.adamw(schedule, b1=job.betas[0], b2=job.betas[1], eps=job.eps,
                        weight_decay=job.weight_decay / job.lr)
    return optax.chain(optax.clip_by_global_norm(job.clip), adamw)


def _cast(tree: Any, dtype: Any) -> Any:
    def cast(leaf: Any) -> Any:
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(leaf.shape, dtype)
        return leaf.astype(dtype)

    return tree if dtype is None else jax.tree.map(cast, tree)


class HandStep:
    """What a careful user writes by hand: plain-dict parameters and one donated ``jax.jit`` train step.

    ``precision`` means what the Trainer's does: ``'amp_bf16'`` keeps float32 weights and casts
    them to bfloat16 inside the step; ``'bf16'`` keeps weights and Adam's moments in bfloat16.
    With ``abstract=True`` nothing is allocated (for compiling only: :meth:`lower`). The loss is
    GPT-2's chunked cross-entropy, as the engine's; ``whole_logits=True`` computes it from the whole
    batch's logits instead (the step before the chunked loss, for the memory comparison).
    """

    def __init__(self, job: Job, precision: str, total_steps: int, seed: int = 0, abstract: bool = False,
                 whole_logits: bool = False) -> None:
        self.job = job
        build = lambda: GPT2(job.config, rngs=nnx.Rngs(seed))  # noqa: E731
        module = nnx.eval_shape(build) if abstract else build()
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        # Plain dicts, not nnx.State: cheaper for jit to flatten on every call.
        params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
        params = _cast(params, jnp.bfloat16 if precision == "bf16" else None)
        compute = None if precision == "fp32" else jnp.bfloat16
        tx = hand_optimizer(job, total_steps)

        def loss_fn(p: Any, r: Any, inputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, Any]:
            model = nnx.merge(graphdef, nnx.State(_cast(p, compute)), nnx.State(r))
            if whole_logits:
                loss = cross_entropy(model(inputs), targets)
            else:
                loss = cross_entropy_loss(model.features(inputs), model.head_weight(), targets,
                                          vocab_size=model.config.vocab_size)
            return loss, nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[2])

        def step(carry: Any, batch: Any) -> tuple[Any, jax.Array]:
            params, rest, opt_state = carry
            (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, *batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), rest, opt_state), loss

        opt_state = jax.eval_shape(tx.init, params) if abstract else tx.init(params)
        self.carry = (params, rest, opt_state)
        self.step = jax.jit(step, donate_argnums=0)
        self.loss: jax.Array | None = None

    def train(self, batches: Sequence[Any]) -> None:
        carry, loss = self.carry, None
        for batch in batches:
            carry, loss = self.step(carry, batch)
        jax.block_until_ready((carry, loss))
        self.carry, self.loss = carry, loss

    def lower(self) -> Any:
        """The lowered step for this job's batch shape (from shapes only: nothing runs)."""
        carry = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), self.carry)
        batch = (jax.ShapeDtypeStruct((self.job.batch_size, self.job.seq_len), jnp.int32),) * 2
        return self.step.lower(carry, batch)


def xla_flops(stage: Any) -> float | None:
    """FLOPs per call from XLA's cost analysis of a lowered or compiled step; None where the backend gives none."""
    try:
        analysis = stage.cost_analysis()
    except Exception:  # best effort: a backend may not provide it
        return None
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    flops = analysis.get("flops") if analysis else None
    return float(flops) if flops is not None and flops >= 0 else None


def step_costs(compiled: Any) -> dict[str, float | None]:
    """``flops`` (:func:`xla_flops`) and ``peak_bytes`` = argument + output + temp − aliased, per device."""
    costs: dict[str, float | None] = {"flops": xla_flops(compiled), "peak_bytes": None}
    memory = compiled.memory_analysis()
    if memory is not None:
        costs["peak_bytes"] = float(memory.argument_size_in_bytes + memory.output_size_in_bytes
                                    - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
    return costs


def engine_step_costs(trainer: Trainer) -> dict[str, float | None]:
    """FLOPs (of the lowered HLO) and peak bytes (of the executable) of the trainer's first train step, from its record.

    The engine records them in ``state.compiled_steps``.
    """
    record = next(step for step in trainer.state.compiled_steps if step.kind == "train")
    memory = record.memory
    peak = (float(memory["argument_size"] + memory["output_size"] - memory["alias_size"] + memory["temp_size"])
            if memory else None)
    return {"flops": record.flops, "peak_bytes": peak}


class HandRun:
    """A :class:`HandStep` racing on fixed batches: ``run()`` trains on all of them and returns tokens/s."""

    def __init__(self, job: Job, batches: list[Any], precision: str, seed: int = 0) -> None:
        self.batches = batches
        self.hand = HandStep(job, precision, total_steps=len(batches), seed=seed)
        lowered = self.hand.lower()
        # FLOPs of the lowered HLO, as the engine records them; jit reuses this compile on the first call.
        self.costs = {"flops": xla_flops(lowered), "peak_bytes": step_costs(lowered.compile())["peak_bytes"]}
        self.hand.train(batches)  # warm up
        self.warmup_loss = float(self.hand.loss)

    def run(self) -> float:
        start = time.perf_counter()
        self.hand.train(self.batches)
        return len(self.batches) * self.hand.job.tokens_per_step / (time.perf_counter() - start)


class EngineRun:
    """The same job through ``Trainer.fit`` on the same batches: ``run()`` fits one more pass and returns tokens/s.

    The first pass (compile and warm-up) runs the whole schedule, as the hand loop's does, so their
    last warm-up losses must agree; each later ``fit(duration)`` extends the run, which stretches
    the cosine (the learning rate's values, not the step's work).
    """

    def __init__(self, job: Job, batches: list[Any], precision: str, seed: int = 0) -> None:
        self.batches, self.job = batches, job
        self.trainer = engine_trainer(job, batches, len(batches), precision, seed)
        self.trainer.fit()
        jax.block_until_ready(self.trainer.state.train_state)
        self.warmup_loss = float(self.trainer.state.loss)
        self.costs = engine_step_costs(self.trainer)

    def run(self) -> float:
        start = time.perf_counter()
        self.trainer.fit(f"{len(self.batches)}ba")
        jax.block_until_ready(self.trainer.state.train_state)
        return len(self.batches) * self.job.tokens_per_step / (time.perf_counter() - start)
