"""Run the compiled steps: device state and its sync with the model, plans, compiles, groups, microbatches."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composerjax.core.engine import Engine, Plan
from composerjax.core.event import Event
from composerjax.core.lifecycle import (
    AFTER_STEP,
    BEFORE_STEP,
    EVAL_BATCH,
    EVAL_CLOSE,
    EVAL_OPEN,
    PREDICT_BATCH,
    PREDICT_CLOSE,
    PREDICT_OPEN,
    STEP,
)
from composerjax.core.state import State, instance_names
from composerjax.core.train_state import TrainState
from composerjax.metrics.collection import StateTotals, compute_values
from composerjax.models.attention import describe_choices, take_attention_choices
from composerjax.models.function_model import ModelFunctions, model_functions
from composerjax.parallel.heartbeat import heartbeat
from composerjax.parallel.sharding import (
    batch_placer,
    batch_sharding,
    global_batch,
    replicated,
    train_state_shardings,
)
from composerjax.parallel.strategy import partition_metadata
from composerjax.step.batch_check import describe_batch, diagnose_batch, note_batch
from composerjax.step.builder import StepBuilder, TripCounted, split_model
from composerjax.step.compile_cache import CACHE_STATS
from composerjax.step.keys import KeyCodec
from composerjax.step.precision import cast_floating, parameter_dtype
from composerjax.step.skipped_updates import SkippedUpdates
from composerjax.step.summary import CompiledStep, costs_of, format_compiled, memory_of

__all__ = ["StepRunner", "batch_size_of", "default_memory_budget"]


@jax.jit
def _with_total_steps(clock: jax.Array, total: jax.Array) -> jax.Array:
    """``clock`` with its second entry (the steps in ``max_duration``) set to ``total``."""
    return clock.at[1].set(total)


def batch_size_of(batch: Any) -> int:
    """The number of samples in a host batch (its first leaf's leading dimension)."""
    return (batch[0] if type(batch) is tuple else jax.tree.leaves(batch)[0]).shape[0]


class StepRunner:
    """Everything between the fit loop and the compiled step.

    It builds the typed device state (:class:`~composerjax.core.train_state.TrainState`) after
    INIT, keeps ``state.model`` in sync with it (merged in only when host code reads the model;
    re-split only after :meth:`State.update_model`), looks up each batch's plan, runs one step or a
    group of steps, records every compile, searches the microbatch size, and runs the eval and
    predict loops. Only this module touches the :class:`StepBuilder`'s caches.

    Args:
        state: the run's state.
        engine: the run's engine.
        logger: for the compile records.
        loss_fn: the Trainer's ``loss_fn`` (plain modules).
        mesh: the device mesh.
        parallelism: the sharding strategy.
        microbatch_size: ``device_train_microbatch_size`` (``'auto'`` searches before the first step).
        device_memory_budget: bytes a step may use, for ``'auto'``.
        report: prints one line per compiled variant (None: silent).
        accumulate_on_tokens: ``accumulate_train_batch_on_tokens``: microbatches weigh by their loss tokens.

    Example::

        runner = StepRunner(state, engine, logger, None, mesh, "auto", None, None)
        runner.build()
        loss, metrics = runner.train_batch(batch)
    """

    def __init__(self, state: State, engine: Engine, logger: Any, loss_fn: Callable[..., Any] | None, mesh: Any,
                 parallelism: Any, microbatch_size: int | str | None, device_memory_budget: int | None,
                 report: Callable[[str], None] | None = None, accumulate_on_tokens: bool = False) -> None:
        self.state, self.engine, self.logger = state, engine, logger
        self.loss_fn, self.mesh, self.parallelism = loss_fn, mesh, parallelism
        self.auto_microbatch = microbatch_size == "auto"
        self.microbatch_size: int | None = None if self.auto_microbatch else microbatch_size  # type: ignore[assignment]
        self.microbatch_candidates: list[dict[str, int]] = []
        self.device_memory_budget = device_memory_budget
        self.report, self.accumulate_on_tokens = report, accumulate_on_tokens
        self.multi_process = jax.process_count() > 1
        #: Puts a host batch on the devices as the train step takes it (the prefetcher places ahead with it).
        self.place: Callable[[Any], Any] = batch_placer(mesh)
        # Whether the step places every batch nobody placed (several devices or processes); one device takes numpy.
        self._places_each = self.multi_process or mesh.devices.size > 1
        self.functions: ModelFunctions = model_functions(state.host_model, loss_fn)
        self._variables: Any = None  # (key, [(path, variable, is_param)]) for sync_model
        self._signature: Any = None  # the last compiled batch's description, for BatchError
        #: The updates ``skip_nonfinite_updates`` skipped, summed on the device.
        self.skipped_updates = SkippedUpdates()

    # -- device state ----------------------------------------------------------------------------
    def build(self) -> None:
        """Split the model (after INIT) into the device state and build the steps' builder."""
        state = self.state
        model = state.host_model
        # INIT may have replaced the model (NoOpModel, wrappers): call whatever model is there now.
        self.functions = model_functions(model, self.loss_fn)
        eval_graphdef = _eval_graphdef(model)
        train_graphdef, params, rest = split_model(model)
        if parameter_dtype(state.precision) != jnp.float32:  # 'bf16': weights and optimizer state too
            params = cast_floating(params, parameter_dtype(state.precision))
        algorithm_state = {}
        for name, algorithm in zip(instance_names(state.algorithms), state.algorithms):
            algorithm.name = name
            initial = algorithm.init_state(state)
            if initial is not None:
                algorithm_state[name] = initial
        state.algorithm_state = algorithm_state
        state.rng, step_key = jax.random.split(state.rng)
        rest_codec = KeyCodec(rest)
        train_state = TrainState(params=params, rest=rest_codec.encode(rest), opt_state=state.optimizer.init(params),
                                 algorithm_state=algorithm_state,
                                 clock=jnp.asarray([0, state.batches_in_duration() or 0], jnp.int32))
        sharding = self._shardings(model, train_state)
        state.train_state = jax.device_put(train_state, sharding)
        state.bind_model_sync(self.sync_model)
        state.model_taken()
        self.batch_sharding = batch_sharding(self.mesh)
        self.builder = StepBuilder(self.engine, state, self.functions, train_graphdef, eval_graphdef, state.optimizer,
                                   self.microbatch_size, sharding, self.batch_sharding, replicated(self.mesh),
                                   rest_codec, np.asarray(jax.random.key_data(step_key)), self.accumulate_on_tokens)

    def replace_optimizer(self, optimizer: Any, keep_state: bool) -> None:
        """Train with ``optimizer`` from now on: its state kept (same structure) or built fresh from the parameters.

        Every compiled train step is dropped (they closed over the old optimizer).
        """
        state, builder = self.state, self.builder
        state.optimizer = builder.optimizer = optimizer
        if not keep_state:
            train_state = state.train_state
            train_state = train_state._replace(opt_state=jax.jit(optimizer.init)(train_state.params))
            sharding = self._shardings(state.host_model, train_state)
            state.train_state = jax.device_put(train_state, sharding)
            builder.train_state_sharding = sharding
        builder.clear()

    def _shardings(self, model: nnx.Module, train_state: TrainState) -> TrainState:
        self.train_state_sharding = train_state_shardings(self.mesh, train_state, self.parallelism,
                                                          partition_metadata(model))
        return self.train_state_sharding

    def sync_model(self) -> None:
        """Merge the device values into ``state.model`` (only when host code reads it)."""
        state = self.state
        train_state, builder = state.train_state, self.builder
        params, rest = train_state.params, builder.rest_codec.decode(train_state.rest)
        # The module's variables, found once per model and graph: nnx.update walks the whole graph
        # (milliseconds per fit() call even for a tiny model); setting each variable is microseconds.
        # A model whose graph changed is always re-split first (update_model), which changes the key.
        key = (state.host_model, builder.train_graphdef, builder.rest_codec)
        cached = self._variables
        if cached is None or any(old is not new for old, new in zip(cached[0], key)):
            variables = [(path, node, isinstance(node, nnx.Param))
                         for path, node in nnx.iter_graph(state.host_model) if isinstance(node, nnx.Variable)]
            self._variables = cached = (key, variables)
        for path, variable, is_param in cached[1]:
            value = params if is_param else rest
            for part in path:
                value = value[part]
            variable.set_value(value)
        state.mark_model_stale(False)

    def take_model(self) -> None:
        """Host code wrote the model (``state.update_model``): re-split it into the device state."""
        state, builder = self.state, self.builder
        state.model_taken()
        model = state.host_model
        eval_graphdef = _eval_graphdef(model)
        graphdef, params, rest = split_model(model)
        builder.rest_codec = KeyCodec(rest)
        if graphdef != builder.train_graphdef:
            builder.train_graphdef, builder.eval_graphdef = graphdef, eval_graphdef
            builder.clear()
        current = state.train_state
        same = jax.tree.structure(params) == jax.tree.structure(current.params)
        updated = current._replace(params=params, rest=builder.rest_codec.encode(rest),
                                   opt_state=current.opt_state if same else state.optimizer.init(params))
        builder.train_state_sharding = self._shardings(model, updated)
        state.train_state = jax.device_put(updated, self.train_state_sharding)

    def set_total_steps(self) -> None:
        """Tell the step how many batches ``max_duration`` spans (for ``state.progress``; 0 if unknown)."""
        state = self.state
        total = jnp.asarray(state.batches_in_duration() or 0, jnp.int32)
        state.train_state = state.train_state._replace(clock=jax.device_put(
            _with_total_steps(state.train_state.clock, total), self.train_state_sharding.clock))

    # -- training --------------------------------------------------------------------------------
    def train_batch(self, batch: Any, placed: Any = None, plan: Plan | None = None) -> tuple[int, Any, Any]:
        """Run one compiled step on ``batch``: ``(global samples, loss, step_metrics)``, no host sync.

        ``placed`` is ``batch`` already on the devices (the device copy of its
        :class:`~composerjax.core.state.BatchRecord`, placed ahead with :attr:`place`), or None;
        ``plan`` the batch's plan when the caller knows it (:meth:`group_plan`), else it is matched here.
        """
        state = self.state
        if state.model_changed:
            self.take_model()
            plan = None
        if plan is None:
            plan = self.builder.plan_train() if state.algorithms else ()
        # Host numpy check before the batch leaves (ComposerClassifier: labels in [0, num_classes)).
        self.functions.check_batch(state.host_model, batch, "train_dataloader", state.timestamp.counts.batch)
        if self.auto_microbatch:
            self._choose_microbatch(plan, batch)
        step = self.builder.train_step(plan)
        samples = (batch[0] if type(batch) is tuple else jax.tree.leaves(batch)[0]).shape[0]
        if placed is None:
            placed = self.place(batch) if self._places_each else batch
        if self.multi_process:
            samples *= jax.process_count()
        compiles, hits, start = state.compile_count, CACHE_STATS.hits, time.perf_counter()
        try:
            # The compiled loop itself (TripCounted's call, without its Python frame) where there is one.
            if type(step) is TripCounted:
                state.train_state, loss, metrics = step.jitted(state.train_state, placed, step.trips)
            else:
                state.train_state, loss, metrics = step(state.train_state, placed)
        except Exception as error:
            self._failed(error, batch, state.compile_count != compiles)
            raise
        if state.compile_count != compiles:
            self._signature = describe_batch(batch)
            self._record("train", plan, step, time.perf_counter() - start, hits, state.train_state, placed)
        state.mark_model_stale()
        if state.skip_nonfinite_updates:
            self.skipped_updates.add(metrics, 1)
        if plan:
            self.engine.record_plan(plan, state.timestamp.counts.batch)
        return samples, loss, metrics

    def group_plan(self, count: int, stops: tuple[Callable[[], bool], ...] = ()) -> Plan | None:
        """The plan shared by the next ``count`` batches, or None if they cannot run as one call.

        The next batches are walked in lifecycle order on predicted timestamps (the last batch's
        size): they can run as one call when nothing would run at their host events (no algorithm
        matches; the plugins listening accept grouped batches) and every batch has the same plan.
        """
        state, engine = self.state, self.engine
        if state.batch is None or self.auto_microbatch or state.model_changed:
            return None
        if not state.algorithms:
            return ()
        size = batch_size_of(state.batch)
        saved = state.timestamp
        plans = set()
        try:
            for _ in range(count):
                if any(a.match(e, state) for e in BEFORE_STEP for a in engine.candidates(e)):
                    return None
                plans.add(self.builder.plan_train())
                state.timestamp = state.timestamp.to_next_batch(size, 0, 0.0)
                if len(plans) > 1 or any(a.match(e, state) for e in AFTER_STEP for a in engine.candidates(e)):
                    return None
        finally:
            state.timestamp = saved
        return plans.pop()

    def train_group(self, stacked: Any, count: int, plan: Plan) -> tuple[Any, Any]:
        """Run ``count`` stacked batches in one compiled call: ``(losses[count], step_metrics[count])``."""
        state, builder = self.state, self.builder
        first = state.timestamp.counts.batch
        self.functions.check_batch(state.host_model, stacked, "train_dataloader",
                                   f"{first}-{first + count - 1} (stacked)")
        step = builder.train_steps(plan, count)
        compiles, hits, start = state.compile_count, CACHE_STATS.hits, time.perf_counter()
        try:
            state.train_state, losses, metrics, (state.loss, state.step_metrics) = step(state.train_state, stacked)
        except Exception as error:
            self._failed(error, jax.tree.map(lambda leaf: leaf[0], stacked), state.compile_count != compiles)
            raise
        if state.compile_count != compiles:
            self._signature = describe_batch(jax.tree.map(lambda leaf: leaf[0], stacked))
            self._record("train", plan, step, time.perf_counter() - start, hits, state.train_state, stacked)
        if plan:
            for index in range(count):
                self.engine.record_plan(plan, first + index)
        state.mark_model_stale()
        if state.skip_nonfinite_updates:
            self.skipped_updates.add(metrics, count)
        return losses, metrics

    def _failed(self, error: Exception, batch: Any, traced: bool) -> None:
        """The step failed on ``batch``: raise a BatchError saying what is wrong with it, or annotate ``error``."""
        index = self.state.timestamp.counts.batch
        problem = diagnose_batch(batch, index, self._signature)
        if problem is not None:
            raise problem from error
        if traced:
            note_batch(error, batch, index)

    def _choose_microbatch(self, plan: Plan, batch: Any) -> None:
        """Pick the largest microbatch whose compiled step fits the memory budget (before any step runs)."""
        self.auto_microbatch = False
        builder, budget = self.builder, self.device_memory_budget
        global_batch_size = batch_size_of(batch) * jax.process_count()
        ways = int(np.prod([self.mesh.shape[axis] for axis in ("data", "fsdp")]))
        divisors = [m for m in range(global_batch_size, 0, -1) if global_batch_size % m == 0]
        candidates = [m for m in divisors if m % ways == 0] or divisors
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                self.state.train_state)
        batch_abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((a.shape[0] * jax.process_count(), *a.shape[1:]), a.dtype,
                                           sharding=self.batch_sharding), batch)
        tried = []
        for size in candidates:
            builder.microbatch_size = None if size == global_batch_size else size
            builder.clear()
            stats = builder.train_step(plan).lower(abstract, batch_abstract).compile().memory_analysis()
            need = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
                    + stats.temp_size_in_bytes)
            tried.append({"microbatch_size": size, "bytes": int(need)})
            if need <= budget:
                break
        else:
            raise ValueError(f"device_train_microbatch_size='auto': no microbatch of the {global_batch_size}-sample "
                             f"batch fits device_memory_budget={budget} bytes; the smallest ({candidates[-1]}) needs "
                             f"{tried[-1]['bytes']} bytes")
        self.microbatch_size = builder.microbatch_size
        self.microbatch_candidates = tried
        self.state.run_summary["microbatch_candidates"] = tried

    # -- eval and predict: one loop ----------------------------------------------------------------
    def evaluate(self, loader: Iterable[Any], label: str = "eval", metric_names: list[str] | None = None,
                 subset_num_batches: int = -1) -> dict[str, float]:
        """Evaluate on ``loader``: the model's eval metrics, exact over every batch, device and process.

        The compiled eval step returns each selected metric's state for its batch; the host merges
        the states batch by batch without waiting for the device, then computes every metric once
        and fetches all values in one transfer. They are logged as ``metrics/<label>/<name>``,
        kept in ``state.metrics[label]`` and returned as ``{name: value}``.

        Args:
            loader: the batches (in multi-process runs, each process's share of the global batch).
            label: the evaluator's label, in the logged names.
            metric_names: regexes matched anywhere in the names of ``model.get_metrics()``, ignoring
                case (Composer's ``Evaluator.metric_names``); None for every metric.
            subset_num_batches: evaluate at most this many batches; -1 for all.

        Raises:
            ValueError: for metric_names that is not a list of strings, or a loader with no batch.
        """
        if metric_names is not None and (isinstance(metric_names, str)
                                         or not all(isinstance(name, str) for name in metric_names)):
            raise ValueError(f"metric_names={metric_names!r}: expected a list of regex strings, or None for every "
                             "metric of model.get_metrics()")
        state, run_event = self.state, self.engine.run_event
        if state.model_changed:
            self.take_model()
        outer_label, state.dataloader_label = state.dataloader_label, label
        try:
            for event in EVAL_OPEN:
                run_event(event)
            names = None if metric_names is None else tuple(metric_names)
            states = self.run_pass("eval", loader, run_event, names, subset_num_batches)
            if states is None:
                raise ValueError(f"eval(): the {label!r} dataloader yielded no batches")
            results = compute_values(states, self.builder.replicated)
            state.metrics[label] = results
            self.logger.log_metrics({f"metrics/{label}/{name}": value for name, value in results.items()})
            for event in EVAL_CLOSE:
                run_event(event)
        finally:
            state.dataloader_label = outer_label
        return results

    def predict(self, loader: Iterable[Any], subset_num_batches: int = -1, return_outputs: bool = True) -> list[Any]:
        """The model's outputs for every batch of ``loader`` (at most ``subset_num_batches``), fetched in one transfer.

        With ``return_outputs=False`` no output is kept or fetched; callbacks still see each
        batch's ``state.outputs`` at ``PREDICT_BATCH_END``.
        """
        if isinstance(subset_num_batches, bool) or not isinstance(subset_num_batches, int) or (
                subset_num_batches == 0 or subset_num_batches < -1):
            raise ValueError(f"predict(subset_num_batches={subset_num_batches!r}): expected a positive number of "
                             "batches or -1 (every batch)")
        if self.state.model_changed:
            self.take_model()
        for event in PREDICT_OPEN:
            self.engine.run_event(event)
        outputs = self.run_pass("predict", loader, self.engine.run_event, subset_num_batches=subset_num_batches,
                                keep_outputs=return_outputs)
        for event in PREDICT_CLOSE:
            self.engine.run_event(event)
        return jax.device_get(outputs)

    def run_pass(self, kind: str, loader: Iterable[Any], event: Callable[[Event], None],
                 metric_names: tuple[str, ...] | None = None, subset_num_batches: int = -1,
                 keep_outputs: bool = True) -> Any:
        """One pass of ``kind`` (``'eval'`` or ``'predict'``) over ``loader``, events in lifecycle order.

        Returns the merged metric states (``{name: state}``, on the device; None without batches)
        for eval and the list of outputs for predict (empty unless ``keep_outputs``). At most
        ``subset_num_batches`` batches run (-1: all); ``metric_names`` applies to eval (see :meth:`evaluate`).
        """
        state, builder = self.state, self.builder
        points = EVAL_BATCH if kind == "eval" else PREDICT_BATCH
        totals, outputs = StateTotals(), []
        for index, batch in enumerate(_epoch_of(loader)):
            if 0 <= subset_num_batches <= index:
                break
            state.batch = batch
            for point in points:
                if point is not STEP:
                    event(point)
                    continue
                if state.model_changed:
                    self.take_model()
                plan = builder.plan_eval() if kind == "eval" else builder.plan_predict()
                step = builder.eval_step(plan, metric_names) if kind == "eval" else builder.predict_step(plan)
                if kind == "eval":
                    self.functions.check_batch(state.host_model, batch, "eval_dataloader", index)
                    device_batch = self._eval_batch(batch)
                else:
                    device_batch = global_batch(batch, self.batch_sharding) if self.multi_process else batch
                train_state = state.train_state
                args = (train_state.params, train_state.rest, train_state.algorithm_state, device_batch)
                compiles, hits, start = state.compile_count, CACHE_STATS.hits, time.perf_counter()
                result = step(*args)
                if state.compile_count != compiles:
                    self._record(kind, plan, step, time.perf_counter() - start, hits, *args)
                if plan:
                    self.engine.record_plan(plan, state.timestamp.counts.batch)
                if kind == "eval":
                    totals.add(result)
                else:
                    state.outputs = result
                    if keep_outputs:
                        outputs.append(result)
            heartbeat()
        return totals.result() if kind == "eval" else outputs

    def _eval_batch(self, batch: Any) -> Any:
        """The batch the eval step takes: global in multi-process runs, else split over the data axes when it divides.

        A batch whose size the data-parallel devices do not divide (an eval set's last batch) stays
        whole on every device: the metrics need every sample, so it is not cut or padded.
        """
        if self.multi_process:
            return global_batch(batch, self.batch_sharding)
        ways = int(np.prod([self.mesh.shape[axis] for axis in ("data", "fsdp")]))
        leaves = jax.tree.leaves(batch)
        if ways > 1 and leaves and all(np.ndim(leaf) and np.shape(leaf)[0] % ways == 0 for leaf in leaves):
            return jax.device_put(batch, self.batch_sharding)
        return batch

    # -- compile records ---------------------------------------------------------------------------
    def _record(self, kind: str, plan: Plan, step: Any, seconds: float, hits_before: int, *args: Any) -> None:
        """Record (and with a report, print) a step variant that was just traced and compiled (or loaded)."""
        from_cache = CACHE_STATS.hits > hits_before
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None))
                                if hasattr(a, "shape") else a, args)
        flops, moved = costs_of(step, *abstract)
        record = CompiledStep(
            kind=kind,
            algorithms=tuple(f"{type(a).__name__}/{event.name}" for event, algorithms in plan for a in algorithms),
            batch_shapes=tuple(tuple(leaf.shape) for leaf in jax.tree.leaves(args[-1])),
            compile_seconds=seconds,
            flops=flops,
            bytes_accessed=moved,
            memory=memory_of(step, *abstract),
            batch=self.state.timestamp.counts.batch,
            from_cache=from_cache,
            attention=describe_choices(take_attention_choices()),
        )
        state = self.state
        state.compiled_steps.append(record)
        cache = state.run_summary.get("compilation_cache")
        if cache is not None:
            cache["steps_loaded"] = cache.get("steps_loaded", 0) + from_cache
            cache["steps_compiled"] = cache.get("steps_compiled", 0) + (not from_cache)
        if kind == "train" and state.run_summary.get("flops_per_step") is None:
            # Tracing the step ahead of FIT_START would run traced events before it: FLOPs come with
            # the first compile instead.
            state.run_summary["flops_per_step"] = record.flops
        if self.report is not None:
            self.logger.log_hyperparameters({f"compiled_steps/{len(state.compiled_steps) - 1}": record.to_dict()})
            self.report(format_compiled(record))


def _eval_graphdef(model: nnx.Module) -> nnx.GraphDef:
    model.eval()
    graphdef = nnx.split(model, nnx.Param, ...)[0]
    model.train()
    return graphdef


def _epoch_of(loader: Iterable[Any]) -> Iterable[Any]:
    """One full pass over ``loader``; an ArrayLoader is reset to the start of its epoch first."""
    if hasattr(loader, "set_epoch") and hasattr(loader, "epoch"):
        loader.set_epoch(loader.epoch)
    return iter(loader)


def default_memory_budget(device: jax.Device) -> int:
    """90% of an accelerator's memory limit; CPU has none to read."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    if not limit:
        raise ValueError(f"device_train_microbatch_size='auto' on {device.platform} needs "
                         "device_memory_budget=<bytes>: this device reports no memory limit to fit the step into")
    return int(limit * 0.9)
