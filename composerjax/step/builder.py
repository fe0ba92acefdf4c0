"""Build and cache the compiled train, eval and predict steps, one per plan."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.extend import core as jax_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composerjax.core.engine import Engine, Plan
from composerjax.core.event import EVAL_STEP_EVENTS, PREDICT_STEP_EVENTS, TRAIN_STEP_EVENTS, Event
from composerjax.core.state import State
from composerjax.core.train_state import TrainState
from composerjax.models.function_model import ModelFunctions
from composerjax.step.keys import KeyCodec
from composerjax.step.precision import cast_floating, compute_dtype
from composerjax.step.token_weights import microbatch_weights
from composerjax.step.view import StepView, traced_view

__all__ = ["StepBuilder", "TripCounted", "split_model", "merge_model"]


class TripCounted:
    """A compiled loop of train steps called with its trip count, a device scalar the compiler cannot see.

    Called and lowered like the jitted step it wraps, without the count: ``step(train_state, batch)``.
    """

    def __init__(self, jitted: Any, trips: jax.Array) -> None:
        self.jitted, self.trips = jitted, trips

    def __call__(self, train_state: Any, batches: Any) -> Any:
        return self.jitted(train_state, batches, self.trips)

    def lower(self, train_state: Any, batches: Any) -> Any:
        """The lowered loop for these (abstract) arguments, as ``jax.jit(...).lower``."""
        return self.jitted.lower(train_state, batches, self.trips)


def convolves(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (a ``jax.extend.core.Jaxpr``), or any jaxpr nested in it, has a convolution.

    Example:
        >>> import jax
        >>> conv = lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME")
        >>> x, w = jax.numpy.ones((1, 1, 4, 4)), jax.numpy.ones((1, 1, 3, 3))
        >>> convolves(jax.make_jaxpr(jax.grad(lambda w: conv(x, w).sum()))(w).jaxpr)
        True
        >>> convolves(jax.make_jaxpr(lambda w: (w @ w).sum())(w).jaxpr)
        False
    """
    for equation in jaxpr.eqns:
        if equation.primitive.name == "conv_general_dilated":
            return True
        for value in equation.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's jaxpr
                if isinstance(inner, jax_core.Jaxpr) and convolves(inner):
                    return True
    return False


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, dict[str, Any], dict[str, Any]]:
    """Split a module into its graph, its parameters and every other variable, as plain dicts.

    Plain nested dicts (not ``nnx.State``) keep the step's pytree cheap to flatten on every call.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def merge_model(graphdef: nnx.GraphDef, params: dict[str, Any], rest: dict[str, Any]) -> nnx.Module:
    """Rebuild a module from ``split_model``'s parts (inside or outside a trace)."""
    return nnx.merge(graphdef, nnx.State(params), nnx.State(rest))


def _rest_of(model: nnx.Module) -> dict[str, Any]:
    return nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[2])


class StepBuilder:
    """Compile the train/eval/predict steps for each plan and keep them.

    The traced events run while a step is traced: the plan (which algorithms matched, in order) is
    baked into the compiled function, so each distinct plan compiles once and jit's own cache adds
    input shapes, dtypes and shardings. ``state.compile_count`` counts the traces, i.e. the real
    compiles.

    Args:
        engine: runs the planned algorithms and the callbacks inside the trace.
        state: the host state (read for hyperparameters; never given tracers).
        functions: how to call the model.
        train_graphdef: the model's graph in train mode.
        eval_graphdef: the model's graph in eval mode.
        optimizer: the optax transform.
        microbatch_size: ``device_train_microbatch_size``; ``None`` for no accumulation.
        train_state_sharding: a pytree (prefix) of shardings for the train state.
        batch_sharding: the sharding of each batch leaf.
        replicated: the sharding of scalars leaving the step.
        rest_codec: turns the model's non-parameter variables (RNG keys) into plain arrays and back.
        step_key_data: the raw data of the run's base key; each step folds its step number in.
        accumulate_on_tokens: weigh microbatches by their loss tokens (``accumulate_train_batch_on_tokens``).
    """

    def __init__(
        self,
        engine: Engine,
        state: State,
        functions: ModelFunctions,
        train_graphdef: nnx.GraphDef,
        eval_graphdef: nnx.GraphDef,
        optimizer: optax.GradientTransformation,
        microbatch_size: int | None,
        train_state_sharding: Any,
        batch_sharding: Any,
        replicated: Any,
        rest_codec: KeyCodec,
        step_key_data: Any,
        accumulate_on_tokens: bool = False,
    ) -> None:
        self.engine = engine
        self.state = state
        self.functions = functions
        self.train_graphdef = train_graphdef
        self.eval_graphdef = eval_graphdef
        self.optimizer = optimizer
        self.microbatch_size, self.accumulate_on_tokens = microbatch_size, accumulate_on_tokens
        self.train_state_sharding = train_state_sharding
        self.batch_sharding = batch_sharding
        self.replicated = replicated
        self.rest_codec = rest_codec
        # The run's step key is a constant of the compiled step: one fewer argument to pass per call.
        self.step_key_data = step_key_data
        self.dtype = compute_dtype(state.precision)
        self._train: dict[Plan, Any] = {}
        self._multi: dict[tuple[Plan, int], Any] = {}
        self._eval: dict[Plan, Any] = {}
        self._predict: dict[Plan, Any] = {}
        #: Steps as loops of unknown length (see :meth:`train_steps`): on CPU, where such a loop costs nothing.
        self.exact_loops = batch_sharding.mesh.devices.flat[0].platform == "cpu"
        #: Plans whose step convolves: their single step is a plain program even with ``exact_loops``.
        self.convolving: set[Plan] = set()

    # -- cache -----------------------------------------------------------------------------------
    def train_step(self, plan: Plan) -> Any:
        """The compiled ``(train_state, batch) -> (train_state, loss, step_metrics)`` for ``plan``.

        With ``exact_loops`` it is :meth:`train_steps`' program for one batch (see there).
        """
        step = self._train.get(plan)
        if step is None:
            if self.exact_loops:
                step = self._looped(plan, 1)
            else:
                step = jax.jit(
                    self._train_fn(plan),
                    in_shardings=(self.train_state_sharding, self.batch_sharding),
                    out_shardings=(self.train_state_sharding, self.replicated, self.replicated),
                    donate_argnums=0,
                )
            self._train[plan] = step
        return step

    def train_steps(self, plan: Plan, count: int) -> Any:
        """``count`` train steps in one compiled call, over batches stacked on a new axis 0.

        ``(train_state, stacked_batch) -> (train_state, losses[count], step_metrics with a leading count,
        (last loss, last step_metrics))``.

        Each step traces the same function as :meth:`train_step` (same plan) and reads its step
        number, and so its ``step_rng`` and ``progress``, from the clock in the carried state,
        which every step advances: step ``i`` of the group sees exactly what the ``i``-th single
        step would.

        With ``exact_loops`` (the default on CPU) one step and a group are the same program: a
        loop whose trip count is an argument, so XLA compiles the step once as the loop's body,
        never specialised for the count, and ``count`` grouped steps are bit-identical to
        ``count`` single steps. (XLA compiles a computation at the top level of a program, or
        in a loop of known length, differently from the same computation in a loop of unknown
        length: it folds constants along other routes and makes other fusion choices, so the
        last bits differ.) On accelerators the group is a ``lax.scan`` and the single step a
        plain program, as fast as each can be (a GPU waits for the device to read a loop's
        condition on every iteration): there grouped steps equal single steps up to rounding.
        """
        key = (plan, count)
        step = self._multi.get(key)
        if step is not None:
            return step
        if self.exact_loops:
            step = self._multi[key] = self._looped(plan, count)
            return step
        single = self._train_fn(plan)

        def steps(train_state: Any, stacked: Any) -> Any:
            def body(state: Any, batch: Any) -> Any:
                state, loss, metrics = single(state, batch)
                return state, (loss, metrics)

            train_state, (losses, metrics) = jax.lax.scan(body, train_state, stacked)
            # The last step's values too, so the host never slices (one dispatch per slice).
            last = (losses[-1], jax.tree.map(lambda value: value[-1], metrics))
            return train_state, losses, metrics, last

        step = self._multi[key] = jax.jit(
            steps,
            in_shardings=(self.train_state_sharding, self._stacked_sharding()),
            out_shardings=(self.train_state_sharding, self.replicated, self.replicated, self.replicated),
            donate_argnums=0,
        )
        return step

    def _stacked_sharding(self) -> NamedSharding:
        return NamedSharding(self.batch_sharding.mesh, P(None, *self.batch_sharding.spec))

    def _looped(self, plan: Plan, count: int) -> TripCounted:
        """``count`` train steps as a loop of unknown length: one batch (``count == 1``) or stacked batches."""
        single = self._train_fn(plan)

        def steps(train_state: Any, batches: Any, trips: jax.Array) -> Any:
            first = batches if count == 1 else jax.tree.map(lambda leaf: leaf[0], batches)
            # Traced once (the engine runs the planned algorithms here), then evaluated as the loop's body.
            closed, shapes = jax.make_jaxpr(single, return_shape=True)(train_state, first)
            call, tree = jax_core.jaxpr_as_fun(closed), jax.tree.structure(shapes)
            if count == 1 and convolves(closed.jaxpr):
                # XLA:CPU runs a convolution inside a loop on a slow generic path (a small CNN's step
                # took 25 times as long), so this single step is a plain program. Grouped steps of
                # such a plan then equal single steps up to rounding; 'auto' never groups them.
                self.convolving.add(plan)
                return jax.tree.unflatten(tree, call(*jax.tree.leaves((train_state, first))))
            _, loss_shape, metric_shapes = shapes
            buffer = lambda shape: jnp.zeros((count, *shape.shape), shape.dtype)  # noqa: E731

            def body(index: jax.Array, carry: Any) -> Any:
                state, losses, metrics = carry
                batch = batches if count == 1 else jax.tree.map(
                    lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False), batches)
                state, loss, step_metrics = jax.tree.unflatten(tree, call(*jax.tree.leaves((state, batch))))
                metrics = jax.tree.map(lambda kept, value: kept.at[index].set(value), metrics, step_metrics)
                return state, losses.at[index].set(loss), metrics

            initial = (train_state, buffer(loss_shape), jax.tree.map(buffer, metric_shapes))
            train_state, losses, metrics = jax.lax.fori_loop(0, trips, body, initial)
            last = (losses[-1], jax.tree.map(lambda value: value[-1], metrics))
            if count == 1:
                return train_state, *last
            return train_state, losses, metrics, last

        outputs = 3 if count == 1 else 4
        jitted = jax.jit(
            steps,
            in_shardings=(self.train_state_sharding, self.batch_sharding if count == 1 else self._stacked_sharding(),
                          self.replicated),
            out_shardings=(self.train_state_sharding, *[self.replicated] * (outputs - 1)),
            donate_argnums=0,
        )
        return TripCounted(jitted, jax.device_put(jnp.asarray(count, jnp.int32), self.replicated))

    def eval_step(self, plan: Plan, metric_names: tuple[str, ...] | None = None) -> Any:
        """The compiled ``(params, rest, algorithm_state, batch) -> {metric: batch state}`` for ``plan``.

        ``metric_names`` (regexes, None: all) selects the model's eval metrics at trace time, so
        each selection compiles once. The states leave replicated: merging and computing them
        then never reads an array another process holds.
        """
        key = (plan, metric_names)
        step = self._eval.get(key)
        if step is None:
            step = self._eval[key] = jax.jit(self._eval_fn(plan, metric_names), out_shardings=self.replicated)
        return step

    def predict_step(self, plan: Plan) -> Any:
        """The compiled ``(params, rest, algorithm_state, batch) -> outputs`` for ``plan``."""
        step = self._predict.get(plan)
        if step is None:
            step = self._predict[plan] = jax.jit(self._predict_fn(plan))
        return step

    def plan_train(self) -> Plan:
        """Match algorithms for the train step's traced events (host, once per batch)."""
        if not self.state.algorithms:
            return ()
        return self.engine.plan(TRAIN_STEP_EVENTS)

    def plan_eval(self) -> Plan:
        """Match algorithms for the eval step's traced events."""
        return self.engine.plan(EVAL_STEP_EVENTS)

    def plan_predict(self) -> Plan:
        """Match algorithms for the predict step's traced events."""
        return self.engine.plan(PREDICT_STEP_EVENTS)

    def clear(self) -> None:
        """Forget every compiled step (after the model's structure changed)."""
        self._train.clear()
        self._multi.clear()
        self._eval.clear()
        self._predict.clear()

    # -- the traced functions --------------------------------------------------------------------
    def _compute_params(self, params: Any) -> Any:
        return cast_floating(params, self.dtype)

    def _merge(self, graphdef: nnx.GraphDef, params: Any, rest: Any) -> nnx.Module:
        return merge_model(graphdef, params, self.rest_codec.decode(rest))

    def _split(self, model: nnx.Module) -> tuple[Any, Any]:
        _, params, rest = split_model(model)
        return params, self.rest_codec.encode(rest)

    def _rest_of(self, model: nnx.Module) -> Any:
        return self.rest_codec.encode(_rest_of(model))

    def _train_fn(self, plan: Plan) -> Any:
        engine, functions, graphdef = self.engine, self.functions, self.train_graphdef
        run = engine.apply_planned
        host_state = self.state

        def loss_and_aux(params: Any, rest: Any, view: StepView) -> tuple[jax.Array, dict[str, Any]]:
            view.model = self._merge(graphdef, self._compute_params(params), rest)
            view.batch = cast_floating(view.batch, self.dtype)
            run(plan, Event.BEFORE_FORWARD, view)
            view.outputs = functions.forward(view.model, view.batch)
            run(plan, Event.AFTER_FORWARD, view)
            run(plan, Event.BEFORE_LOSS, view)
            loss, loss_metrics = functions.loss(view.model, view.outputs, view.batch, view.step_rng, view.step)
            view.loss = jnp.asarray(loss, jnp.float32)
            view.step_metrics.update(loss_metrics)
            run(plan, Event.AFTER_LOSS, view)
            run(plan, Event.BEFORE_BACKWARD, view)
            # Whatever algorithms set in here may only leave through aux: its tracers belong to grad.
            aux = {
                "rest": self._rest_of(view.model),
                "batch": view.batch,
                "outputs": view.outputs,
                "algorithm_state": dict(view.algorithm_state),
                "step_metrics": dict(view.step_metrics),
            }
            return view.loss, aux

        grad_fn = jax.value_and_grad(loss_and_aux, has_aux=True)

        def backward(view: StepView, params: Any, rest: Any) -> tuple[Any, Any]:
            (loss, aux), grads = grad_fn(params, rest, view)
            view.loss, view.batch, view.outputs = loss, aux["batch"], aux["outputs"]
            view.algorithm_state, view.step_metrics = aux["algorithm_state"], aux["step_metrics"]
            view.grads = grads
            view.model = self._merge(graphdef, params, aux["rest"])
            run(plan, Event.AFTER_BACKWARD, view)
            return view.grads, aux["rest"]

        def plain_loss_and_grad(params: Any, rest: Any, batch: Any, rng: Any, step: Any) -> Any:
            def loss_only(p: Any) -> jax.Array:
                model = self._merge(graphdef, self._compute_params(p), rest)
                batch_c = cast_floating(batch, self.dtype)
                outputs = functions.forward(model, batch_c)
                return jnp.asarray(functions.loss(model, outputs, batch_c, rng, step)[0], jnp.float32)

            return jax.value_and_grad(loss_only)(params)

        def train_step(train_state: TrainState, batch: Any) -> tuple[TrainState, jax.Array, Any]:
            host_state.compile_count += 1  # runs once per trace, i.e. once per real compile
            # clock = [optimizer steps so far, steps in max_duration (0 when unknown)].
            clock = train_state.clock
            step, total_steps = clock[0], clock[1]
            params, rest = train_state.params, train_state.rest
            step_rng = jax.random.fold_in(jax.random.wrap_key_data(jnp.asarray(self.step_key_data)), step)
            view = traced_view(
                host_state,
                batch=batch,
                step=step,
                progress=jnp.where(total_steps > 0, step / jnp.maximum(total_steps, 1), 0.0).astype(jnp.float32),
                step_rng=step_rng,
                params=params,
                model=self._merge(graphdef, params, rest),
                outputs=None,
                loss=None,
                grads=None,
                algorithm_state=train_state.algorithm_state,
            )
            view.forward = lambda p, b: functions.forward(
                self._merge(graphdef, self._compute_params(p), rest), cast_floating(b, self.dtype))
            view.loss_and_grad = lambda p, b: plain_loss_and_grad(p, rest, b, step_rng, step)
            run(plan, Event.BEFORE_TRAIN_BATCH, view)
            params, rest = self._split(view.model)
            view.params = params

            if self.microbatch_size is None:
                grads, rest = backward(view, params, rest)
            else:
                grads, rest = self._accumulate(view, params, rest, backward)
            # Train metrics (off unless the model's get_metrics(is_train=True) gives some), on the whole batch.
            view.step_metrics.update(functions.train_metric_values(view.model, view.batch, view.outputs))

            # Composer's order: AFTER_TRAIN_BATCH sees the whole batch's gradients before the update,
            # and the optimizer applies what it leaves in state.grads (GradientClipping clips there).
            view.params, view.grads = params, grads
            view.model = self._merge(graphdef, params, rest)
            run(plan, Event.AFTER_TRAIN_BATCH, view)
            params, rest = self._split(view.model)
            grads = view.grads
            updates, opt_state = self.optimizer.update(grads, train_state.opt_state, params)
            params = optax.apply_updates(params, updates)
            view.params = params
            view.model = self._merge(graphdef, params, rest)
            run(plan, Event.AFTER_OPTIMIZER_STEP, view)
            params, rest = self._split(view.model)
            algorithm_state = dict(view.algorithm_state)
            if host_state.skip_nonfinite_updates:
                # A NaN/Inf loss or gradient leaves every trained value as it was; the batch still counts.
                finite = jnp.isfinite(view.loss) & jnp.all(
                    jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)] or [jnp.bool_(True)]))
                keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
                params = keep(params, train_state.params)
                rest = keep(rest, train_state.rest)
                opt_state = keep(opt_state, train_state.opt_state)
                algorithm_state = keep(algorithm_state, train_state.algorithm_state)
                view.step_metrics["skipped_nonfinite"] = jnp.logical_not(finite).astype(jnp.float32)
            new_state = TrainState(params=params, rest=rest, opt_state=opt_state, algorithm_state=algorithm_state,
                                   clock=clock.at[0].add(1))
            return new_state, view.loss, dict(view.step_metrics)

        return train_step

    def _accumulate(self, view: StepView, params: Any, rest: Any, backward: Any) -> tuple[Any, Any]:
        """Mean gradients over microbatches with a ``lax.scan``; traced events run per microbatch.

        Each microbatch weighs equally, or, with ``accumulate_on_tokens``, by its share of the batch's
        loss tokens (:func:`~composerjax.step.token_weights.microbatch_weights`; equally when the model
        counts none). Step metrics are the microbatches' plain mean either way.
        """
        full_batch = view.batch
        size = jax.tree.leaves(full_batch)[0].shape[0]
        micro = self.microbatch_size
        if size % micro:
            raise ValueError(
                f"device_train_microbatch_size={micro} does not divide the batch size {size}; "
                "choose a divisor of the (global) batch size"
            )
        count = size // micro
        stacked = jax.tree.map(lambda x: x.reshape((count, micro, *x.shape[1:])), full_batch)
        # Counted on the batch as BEFORE_TRAIN_BATCH left it, before any microbatch's forward (Composer's order).
        weights = microbatch_weights(self.functions, view.model, stacked) if self.accumulate_on_tokens else None

        step_rng = view.step_rng

        def body(carry: Any, indexed: Any) -> tuple[Any, Any]:
            grad_sum, rest, algorithm_state = carry
            index, microbatch, weight = indexed
            view.batch, view.algorithm_state = microbatch, algorithm_state
            # A distinct key per microbatch, so random augmentations differ between them.
            view.step_rng = jax.random.fold_in(step_rng, index)
            grads, rest = backward(view, params, rest)
            if weight is not None:  # Composer's scaling: this microbatch's loss tokens over the batch's
                grads = jax.tree.map(lambda g: g * weight.astype(g.dtype), grads)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            return (grad_sum, rest, dict(view.algorithm_state)), (view.loss, view.outputs, view.step_metrics)

        zeros = jax.tree.map(jnp.zeros_like, params)
        init = (zeros, rest, dict(view.algorithm_state))
        (grad_sum, rest, algorithm_state), (losses, outputs, metrics) = jax.lax.scan(
            body, init, (jnp.arange(count), stacked, weights)
        )
        view.batch, view.step_rng = full_batch, step_rng
        view.algorithm_state = algorithm_state
        view.loss = jnp.mean(losses) if weights is None else jnp.sum(losses * weights)
        view.outputs = jax.tree.map(lambda x: x.reshape((size, *x.shape[2:])), outputs)
        view.step_metrics = jax.tree.map(lambda x: jnp.mean(x, axis=0), metrics)
        grads = jax.tree.map(lambda g: g / count, grad_sum) if weights is None else grad_sum
        view.grads = grads
        return grads, rest

    def _eval_fn(self, plan: Plan, metric_names: tuple[str, ...] | None = None) -> Any:
        functions = self.functions
        names = None if metric_names is None else list(metric_names)
        # As Composer: the metrics read the outputs after EVAL_AFTER_FORWARD.
        return self._forward_fn(plan, "eval_step", Event.EVAL_BEFORE_FORWARD, Event.EVAL_AFTER_FORWARD,
                                functions.eval_forward,
                                lambda view: functions.metric_states(view.model, view.batch, view.outputs, names))

    def _predict_fn(self, plan: Plan) -> Any:
        return self._forward_fn(plan, "predict_step", Event.PREDICT_BEFORE_FORWARD, Event.PREDICT_AFTER_FORWARD,
                                self.functions.predict, lambda view: view.outputs)

    def _forward_fn(self, plan: Plan, name: str, before: Event, after: Event, forward: Callable[[Any, Any], Any],
                    result: Callable[[Any], Any]) -> Any:
        """A forward-only step (eval, predict): ``before``, ``forward(model, batch)``, ``after``, ``result(view)``."""
        engine, graphdef = self.engine, self.eval_graphdef
        host_state = self.state

        def step(params: Any, rest: Any, algorithm_state: Any, batch: Any) -> Any:
            host_state.compile_count += 1
            view = traced_view(host_state, batch=cast_floating(batch, self.dtype), params=params,
                               model=self._merge(graphdef, self._compute_params(params), rest),
                               outputs=None, algorithm_state=algorithm_state)
            engine.apply_planned(plan, before, view)
            view.outputs = forward(view.model, view.batch)
            engine.apply_planned(plan, after, view)
            return result(view)

        step.__name__ = step.__qualname__ = name  # what jit names the compiled step
        return step

