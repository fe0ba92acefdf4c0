"""Registries: built-ins found through their entry points, names forgiving of case and separators,
import paths, helpful unknown-name errors, hyperparameter models from signatures and docstrings."""

from __future__ import annotations

import importlib.metadata
import inspect
import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pydantic
import pytest
from flax import nnx

import composerjax.algorithms as algorithm_module
import composerjax.callbacks as callback_module
import composerjax.loggers as logger_module
from composerjax import Algorithm, Callback, ComposerClassifier, LoggerDestination, Trainer, registry
from composerjax.algorithms import EMA, MixUp, NoOpModel
from composerjax.callbacks import SpeedMonitor, ThresholdStopper
from composerjax.data.factories import DataSplits, digits, pydoc_text
from composerjax.loggers import (
    ConsoleLogger,
    FileLogger,
    InMemoryLogger,
    MLFlowLogger,
    ProgressBarLogger,
    TensorboardLogger,
    WandBLogger,
)
from composerjax.models import factories
from composerjax.registry import Registry, UnknownNameError, describe_hparams, docstring_args, hparams_model


def exported_subclasses(module, base) -> set[type]:
    return {obj for name in module.__all__ if isinstance(obj := getattr(module, name), type) and issubclass(obj, base)
            and obj is not base}


@pytest.mark.parametrize("kind, module, base", [
    ("algorithms", algorithm_module, Algorithm),
    ("callbacks", callback_module, Callback),
    ("loggers", logger_module, LoggerDestination),
])
def test_every_exported_builtin_is_registered_under_a_snake_case_name(kind, module, base):
    reg = registry.REGISTRIES[kind]
    for cls in exported_subclasses(module, base):
        name = reg.name_of(cls)
        assert name is not None, f"{cls.__name__} has no entry point in group {reg.group}"
        assert name == name.lower() and reg.get(name) is cls


def test_builtin_names_resolve_to_their_classes():
    expected = {
        "algorithms": {"label_smoothing": "LabelSmoothing", "mixup": "MixUp", "cutmix": "CutMix",
                       "cutout": "CutOut", "colout": "ColOut", "randaugment": "RandAugment", "augmix": "AugMix",
                       "progressive_resizing": "ProgressiveResizing", "seq_length_warmup": "SeqLengthWarmup",
                       "selective_backprop": "SelectiveBackprop", "gradient_clipping": "GradientClipping",
                       "sam": "SAM", "ema": "EMA", "swa": "SWA", "layer_freezing": "LayerFreezing",
                       "low_precision_layernorm": "LowPrecisionLayerNorm", "blurpool": "BlurPool",
                       "squeeze_excite": "SqueezeExcite", "stochastic_depth": "StochasticDepth",
                       "ghost_batchnorm": "GhostBatchNorm", "weight_standardization": "WeightStandardization",
                       "factorize": "Factorize", "alibi": "Alibi", "gated_linear_units": "GatedLinearUnits",
                       "no_op_model": "NoOpModel", "gyro_dropout": "GyroDropout", "channels_last": "ChannelsLast",
                       "low_precision_groupnorm": "LowPrecisionGroupNorm"},
        "callbacks": {"speed_monitor": "SpeedMonitor", "lr_monitor": "LRMonitor", "memory_monitor": "MemoryMonitor",
                      "optimizer_monitor": "OptimizerMonitor", "early_stopper": "EarlyStopper",
                      "threshold_stopper": "ThresholdStopper", "nan_monitor": "NaNMonitor",
                      "runtime_estimator": "RuntimeEstimator", "image_visualizer": "ImageVisualizer",
                      "activation_monitor": "ActivationMonitor", "system_metrics_monitor": "SystemMetricsMonitor",
                      "profiler": "Profiler", "trace_recorder": "TraceRecorder"},
    }
    for kind, names in expected.items():
        module = algorithm_module if kind == "algorithms" else callback_module
        for name, class_name in names.items():
            assert registry.resolve(kind, name) is getattr(module, class_name)
    assert registry.loggers.get("console") is ConsoleLogger
    assert registry.loggers.get("progress_bar") is ProgressBarLogger
    assert registry.loggers.get("tensorboard") is TensorboardLogger
    assert registry.loggers.get("file") is FileLogger
    assert registry.loggers.get("in_memory") is InMemoryLogger
    assert registry.loggers.get("wandb") is WandBLogger and registry.loggers.get("mlflow") is MLFlowLogger
    assert {"digits_cnn", "small_resnet", "tiny_gpt", "mlp"} <= set(registry.models.names())
    assert registry.models.get("tiny_gpt") is factories.tiny_gpt
    assert registry.data.get("digits") is digits and registry.data.get("pydoc_text") is pydoc_text
    assert registry.resolve("algorithm", "ema") is EMA  # singular kinds work too


def test_names_match_ignoring_case_underscores_and_dashes():
    for spelling in ("mixup", "MixUp", "mix_up", "MIX-UP"):
        assert registry.algorithms.get(spelling) is MixUp
        assert spelling in registry.algorithms
    assert registry.callbacks.get("SpeedMonitor") is SpeedMonitor
    assert registry.algorithms.get("NoOpModel") is NoOpModel
    assert "nothing_like_this" not in registry.algorithms and 3 not in registry.algorithms
    assert registry.algorithms.names() == sorted(registry.algorithms.names())


def test_name_of_finds_classes_instances_and_factories():
    assert registry.algorithms.name_of(MixUp) == "mixup"
    assert registry.algorithms.name_of(MixUp(alpha=0.3)) == "mixup"
    assert registry.callbacks.name_of(ThresholdStopper) == "threshold_stopper"
    assert registry.models.name_of(factories.digits_cnn) == "digits_cnn"
    assert registry.data.name_of(pydoc_text) == "pydoc_text"
    assert registry.algorithms.name_of(SpeedMonitor) is None


def test_import_paths_resolve_without_registration():
    assert registry.algorithms.get("composerjax.algorithms.mixup:MixUp") is MixUp
    assert registry.models.get("composerjax.models:ComposerClassifier.loss") is ComposerClassifier.loss


@pytest.mark.parametrize("path, fragments", [
    ("composerjax.algorithmz:MixUp", ["cannot import module 'composerjax.algorithmz'"]),
    ("composerjax.algorithms:MixUpp", ["'composerjax.algorithms' has no attribute 'MixUpp'", "did you mean 'MixUp'"]),
    ("composerjax.models:ComposerClassifier.los", ["'composerjax.models:ComposerClassifier' has no attribute 'los'"]),
    (":MixUp", ["'package.module:attribute'"]),
])
def test_import_path_errors_name_the_module_or_attribute(path, fragments):
    with pytest.raises(UnknownNameError) as caught:
        registry.algorithms.get(path)
    for fragment in fragments:
        assert fragment in str(caught.value)
    assert caught.value.name == path and caught.value.kind == "algorithm"


def test_import_path_keeps_a_missing_dependency_of_an_existing_module(tmp_path, monkeypatch):
    (tmp_path / "needs_missing_dependency.py").write_text("import no_such_dependency_for_composerjax\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_for_composerjax"):
        registry.algorithms.get("needs_missing_dependency:Thing")


def test_unknown_names_suggest_the_closest_registered_ones():
    with pytest.raises(UnknownNameError) as caught:
        registry.algorithms.get("mixpu")
    error = caught.value
    assert isinstance(error, ValueError) and isinstance(error, LookupError)
    assert (error.kind, error.name) == ("algorithm", "mixpu")
    assert error.suggestions[0] == "mixup"
    message = str(error)
    assert "unknown algorithm 'mixpu'" in message and "did you mean 'mixup'" in message
    assert "'label_smoothing'" in message and "'weight_standardization'" in message  # the registered names
    with pytest.raises(UnknownNameError, match="did you mean 'speed_monitor'") as caught:
        registry.callbacks.get("SpeedMonitr")
    assert caught.value.kind == "callback"
    with pytest.raises(UnknownNameError) as caught:
        registry.algorithms.get("zzzzzz")
    assert caught.value.suggestions == [] and "did you mean" not in str(caught.value)
    with pytest.raises(UnknownNameError, match="unknown registry 'algorithmz'"):
        registry.resolve("algorithmz", "mixup")


def test_register_as_call_or_decorator_and_refuse_silent_replacement():
    shapes = Registry("shape", "composerjax.tests.no_such_group")

    @shapes.register("Unit-Square")
    class UnitSquare:
        pass

    def circle(radius: float = 1.0):
        return ("circle", radius)

    assert shapes.register("circle", circle) is circle
    assert shapes.register("circle", circle) is circle  # the same object again: no-op
    assert shapes.names() == ["Unit-Square", "circle"]
    assert shapes.get("unit_square") is UnitSquare and shapes.name_of(UnitSquare()) == "Unit-Square"
    assert shapes.items() == [("Unit-Square", UnitSquare), ("circle", circle)]
    with pytest.raises(ValueError, match="already registered"):
        shapes.register("CIRCLE", UnitSquare)
    shapes.register("circle", UnitSquare, replace=True)
    assert shapes.get("circle") is UnitSquare
    with pytest.raises(ValueError, match="without ':'"):
        shapes.register("a:b", circle)


def test_entry_points_load_lazily_and_a_broken_one_only_warns(monkeypatch):
    group = "composerjax.tests.example_group"
    points = [
        importlib.metadata.EntryPoint("broken", "no_such_module_for_composerjax:Thing", group),
        importlib.metadata.EntryPoint("mix_up", "composerjax.algorithms.mixup:MixUp", group),
    ]
    asked = []

    def entry_points(group):
        asked.append(group)
        return points

    monkeypatch.setattr(registry.importlib.metadata, "entry_points", entry_points)
    plugins = Registry("plugin", group)
    assert asked == []  # nothing is read before first use
    assert plugins.names() == ["broken", "mix_up"] and asked == [group]
    assert plugins.name_of(MixUp) == "mix_up"  # matched by entry-point value, nothing imported
    with pytest.warns(registry.PluginLoadWarning, match="'broken'.*no_such_module_for_composerjax.*ModuleNotFound"):
        pairs = plugins.items()
    assert pairs == [("mix_up", MixUp)] and plugins.names() == ["mix_up"]
    with pytest.raises(UnknownNameError, match="failed to load"):
        plugins.get("broken")
    assert asked == [group]


def test_mixup_hparams_validate_types_and_forbid_unknown_fields():
    model = hparams_model(MixUp)
    hparams = model(alpha=1, interpolate_loss=True)
    assert isinstance(hparams.alpha, float) and hparams.alpha == 1.0
    assert hparams.model_dump() == {"alpha": 1.0, "interpolate_loss": True, "input_key": 0, "target_key": 1,
                                    "num_classes": None}
    assert MixUp(**hparams.model_dump()).alpha == 1.0
    with pytest.raises(pydantic.ValidationError, match="alpha"):
        model(alpha="a lot")
    with pytest.raises(pydantic.ValidationError, match="alhpa"):
        model(alhpa=0.2)
    with pytest.raises(pydantic.ValidationError, match="monitor"):
        hparams_model(ThresholdStopper)()  # required: no default
    assert hparams_model(MixUp) is model


def test_hparams_model_uses_a_declared_model_and_tolerates_unannotated_or_unresolvable_parameters():
    class Declared(pydantic.BaseModel):
        rate: float = 0.5

    class WithModel:
        hparams_model = Declared

        def __init__(self, rate: float = 0.5) -> None:
            self.rate = rate

    assert hparams_model(WithModel) is Declared

    def factory(size, label: str = "x", *args):
        return size

    factory.__annotations__["label"] = "NameOnlyKnownToATypeChecker"
    model = hparams_model(factory)
    assert set(model.model_fields) == {"size", "label"}
    assert model(size=[1, 2], label=3).model_dump() == {"size": [1, 2], "label": 3}  # both Any
    with pytest.raises(pydantic.ValidationError, match="size"):
        model()
    with pytest.raises(pydantic.ValidationError, match="unknown"):
        model(size=1, unknown=2)

    class Forwarding(MixUp):
        def __init__(self, scale: float = 1.0, **kwargs) -> None:
            super().__init__(**kwargs)
            self.scale = scale

    forwarded = hparams_model(Forwarding)(scale=2, alpha=0.5)  # **kwargs: extra keys pass through
    assert forwarded.model_dump() == {"scale": 2.0, "alpha": 0.5}
    assert Forwarding(**forwarded.model_dump()).alpha == 0.5


@pytest.mark.parametrize("kind", sorted(registry.REGISTRIES))
def test_every_registered_entry_has_a_described_hparams_model(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, obj in registry.REGISTRIES[kind].items():
            hparams_model(obj)
            for row in describe_hparams(obj):
                assert row["description"], f"{kind}/{name}: {row['name']} has no description in its docstring"


def test_describe_hparams_reads_types_defaults_and_docstrings():
    alpha, interpolate_loss, *_ = describe_hparams(MixUp)
    assert alpha["name"] == "alpha" and alpha["type"] == "float" and alpha["default"] == 0.2
    assert not alpha["required"] and alpha["description"].startswith("concentration of the symmetric Beta")
    assert "Default: ``False``" in interpolate_loss["description"]
    sizes, seed = describe_hparams(factories.mlp)
    assert sizes == {"name": "sizes", "type": "list[int]", "default": None, "required": True,
                     "description": "layer widths, input features first and the number of classes last."}
    assert seed["default"] == 0 and seed["description"] == "seeds the parameter initialisation."


def test_docstring_args_parses_google_style_sections():
    doc = inspect.cleandoc("""Do a thing.

    Args:
        first (int): the first,
            continued here.
        *rest: everything else.

            A second paragraph.
        last: the end.

    Returns:
        nothing: not an argument.
    """)
    assert docstring_args(doc) == {"first": "the first, continued here.",
                                   "rest": "everything else. A second paragraph.", "last": "the end."}
    assert docstring_args(None) == {} and docstring_args("No sections.") == {}


def test_model_factories_build_classifiers():
    def output_shape(name, inputs, **hparams):
        # Abstract build and forward (shapes only): eager initialisation would cost seconds per model.
        model = nnx.eval_shape(lambda: registry.models.get(name)(**hparams))
        assert isinstance(model, ComposerClassifier)
        return nnx.eval_shape(lambda model, inputs: model.forward((inputs, None)), model, inputs).shape

    images, tokens = jnp.zeros((2, 8, 8)), jnp.zeros((2, 8), jnp.int32)
    assert output_shape("digits_cnn", images, num_classes=10) == (2, 10)
    assert output_shape("small_resnet", images, num_classes=3, width=4) == (2, 3)
    assert output_shape("mlp", images, sizes=[64, 8, 5]) == (2, 5)
    assert output_shape("tiny_gpt", tokens, dim=16, depth=1, num_heads=2, max_length=8) == (2, 8, 256)
    with pytest.raises(ValueError, match="sizes"):
        factories.mlp([10])


def test_pydoc_text_splits_next_byte_windows():
    splits = registry.data.get("pydoc_text")(seq_len=16, batch_size=8, eval_fraction=0.25)
    assert isinstance(splits, DataSplits)
    inputs, targets = next(iter(splits.train))
    assert inputs.shape == targets.shape == (8, 16) and inputs.dtype == targets.dtype == np.int32
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    train_batches, eval_batches = len(splits.train), len(splits.eval)
    assert eval_batches * 8 >= (train_batches * 8 + eval_batches * 8) * 0.25 * 0.9
    assert pydoc_text(seq_len=16, eval_fraction=0.0).eval is None
    with pytest.raises(ValueError, match="eval_fraction"):
        pydoc_text(eval_fraction=1.0)


def test_digits_and_digits_cnn_from_the_registry_train_two_batches():
    splits = registry.data.get("digits")(batch_size=16)
    x, y = next(iter(splits.train))
    assert x.shape == (16, 8, 8) and y.dtype == np.int32 and len(splits.eval) == 3
    model = registry.models.get("digits_cnn")(num_classes=10)
    trainer = Trainer(model, splits.train, "2ba", optax.sgd(0.05), progress_bar=False, run_summary=False)
    trainer.fit()
    assert trainer.state.timestamp.batch == 2 and np.isfinite(float(trainer.state.loss))
