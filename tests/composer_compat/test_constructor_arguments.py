"""Every algorithm and callback takes Composer's constructor arguments, with Composer's defaults.

``COMPOSER_SIGNATURES`` is Composer 0.32's ``__init__`` of each class, argument for argument (the
defaults as Composer writes them; ``REQUIRED`` where Composer has none). ``DOC_EXAMPLES`` are the
calls Composer's method cards and docstrings show. Each class here must accept both, and every
default must equal Composer's except the differences listed in ``DELIBERATE`` (each documented in
the method card or docstring and in docs/migrating-from-composer.md).
"""

from __future__ import annotations

import inspect

import pytest

from composerjax import Event
from composerjax import algorithms as algorithms_module
from composerjax import callbacks as callbacks_module
from composerjax.checkpoint.saver import CheckpointSaver

REQUIRED = object()

COMPOSER_SIGNATURES: dict[str, dict[str, object]] = {
    # algorithms
    "Alibi": {"max_sequence_length": REQUIRED, "train_sequence_length_scaling": 0.25},
    "AugMix": {"severity": 3, "depth": -1, "width": 3, "alpha": 1.0, "augmentation_set": "all"},
    "BlurPool": {"replace_convs": True, "replace_maxpools": True, "blur_first": True, "min_channels": 16},
    "ChannelsLast": {},
    "ColOut": {"p_row": 0.15, "p_col": 0.15, "batch": True, "resize_target": "auto", "input_key": 0, "target_key": 1},
    "CutMix": {"alpha": 1.0, "interpolate_loss": False, "uniform_sampling": False, "input_key": 0, "target_key": 1},
    "CutOut": {"num_holes": 1, "length": 0.5, "uniform_sampling": False, "input_key": 0},
    "EMA": {"half_life": "1000ba", "smoothing": None, "ema_start": "0.0dur", "update_interval": None},
    "Factorize": {"factorize_convs": True, "factorize_linears": True, "min_channels": 256, "latent_channels": 0.25,
                  "min_features": 256, "latent_features": 128},
    "GatedLinearUnits": {"act_fn": None, "gated_layer_bias": False, "non_gated_layer_bias": False},
    "GhostBatchNorm": {"ghost_batch_size": 32},
    "GradientClipping": {"clipping_type": REQUIRED, "clipping_threshold": REQUIRED},
    "GyroDropout": {"p": 0.5, "sigma": 256, "tau": 16},
    "LabelSmoothing": {"smoothing": 0.1, "target_key": 1},
    "LayerFreezing": {"freeze_start": 0.5, "freeze_level": 1.0},
    "LowPrecisionGroupNorm": {"apply_at": Event.INIT},
    "LowPrecisionLayerNorm": {"apply_at": Event.INIT},
    "MixUp": {"alpha": 0.2, "interpolate_loss": False, "input_key": 0, "target_key": 1},
    "NoOpModel": {},
    "ProgressiveResizing": {"mode": "resize", "initial_scale": 0.5, "finetune_fraction": 0.2, "delay_fraction": 0.5,
                            "size_increment": 4, "resize_targets": False, "input_key": 0, "target_key": 1},
    "RandAugment": {"severity": 9, "depth": 2, "augmentation_set": "all"},
    "SAM": {"rho": 0.05, "epsilon": 1e-12, "interval": 1},
    "SelectiveBackprop": {"start": 0.5, "end": 0.9, "keep": 0.5, "scale_factor": 1.0, "interrupt": 2, "input_key": 0,
                          "target_key": 1},
    "SeqLengthWarmup": {"duration": 0.3, "min_seq_length": 8, "max_seq_length": 1024, "step_size": 8, "truncate": True,
                        "preserve_end_of_sequence": False},
    "SqueezeExcite": {"latent_channels": 64, "min_channels": 128},
    "StochasticDepth": {"target_layer_name": REQUIRED, "stochastic_method": "block", "drop_rate": 0.2,
                        "drop_distribution": "linear", "drop_warmup": 0.0},
    "SWA": {"swa_start": "0.7dur", "swa_end": "0.97dur", "update_interval": "1ep", "schedule_swa_lr": False,
            "anneal_strategy": "linear", "anneal_steps": 10, "swa_lr": None},
    "WeightStandardization": {"n_last_layers_ignore": 0},
    # callbacks
    "ActivationMonitor": {"interval": "25ba", "ignore_module_types": None, "only_log_wandb": True},
    "EarlyStopper": {"monitor": REQUIRED, "dataloader_label": REQUIRED, "comp": None, "min_delta": 0.0, "patience": 1},
    "ImageVisualizer": {"interval": "100ba", "mode": "input", "num_images": 8, "channels_last": False, "input_key": 0,
                        "target_key": 1},
    "LRMonitor": {},
    "MemoryMonitor": {"memory_keys": None, "dist_aggregate_batch_interval": None},
    "NaNMonitor": {},
    "OptimizerMonitor": {"log_optimizer_metrics": True, "batch_log_interval": 10},
    "RuntimeEstimator": {"skip_batches": 1, "time_unit": "hours"},
    "SpeedMonitor": {"window_size": 100, "gpu_flops_available": None, "time_unit": "hours"},
    "SystemMetricsMonitor": {"log_all_data": False},
    "ThresholdStopper": {"monitor": REQUIRED, "dataloader_label": REQUIRED, "threshold": REQUIRED, "comp": None,
                         "stop_on_batch": False},
}

# Values for Composer's required arguments.
REQUIRED_VALUES = {
    "max_sequence_length": 1024, "clipping_type": "norm", "clipping_threshold": 0.1,
    "target_layer_name": "BasicBlock", "monitor": "MulticlassAccuracy", "dataloader_label": "eval", "threshold": 0.7,
}

# Composer's method cards (composer/algorithms/*/README.md) and callback docstrings.
DOC_EXAMPLES: list[tuple[str, dict[str, object]]] = [
    ("Alibi", {"max_sequence_length": 1024, "train_sequence_length_scaling": 0.25}),
    ("AugMix", {"severity": 3, "width": 3, "depth": -1, "alpha": 1.0, "augmentation_set": "all"}),
    ("BlurPool", {"replace_convs": True, "replace_maxpools": True}),
    ("ChannelsLast", {}),
    ("ColOut", {"p_row": 0.15, "p_col": 0.15, "batch": True}),
    ("CutMix", {"alpha": 1.0}),
    ("CutOut", {"num_holes": 1, "length": 0.5}),
    ("EMA", {"half_life": "50ba"}),
    ("Factorize", {"factorize_convs": True, "factorize_linears": True, "min_channels": 256, "latent_channels": 0.25,
                   "min_features": 256, "latent_features": 128}),
    ("GatedLinearUnits", {}),
    ("GhostBatchNorm", {"ghost_batch_size": 32}),
    ("GradientClipping", {"clipping_type": "adaptive", "clipping_threshold": 0.1}),
    ("GyroDropout", {"p": 0.5, "sigma": 256, "tau": 16}),
    ("LabelSmoothing", {"smoothing": 0.1}),
    ("LayerFreezing", {"freeze_start": 0.0, "freeze_level": 1.0}),
    ("LowPrecisionGroupNorm", {}),
    ("LowPrecisionLayerNorm", {}),
    ("MixUp", {"alpha": 0.2, "interpolate_loss": True}),
    ("ProgressiveResizing", {"mode": "resize", "initial_scale": 1.0, "finetune_fraction": 0.2, "delay_fraction": 0.2,
                             "size_increment": 32, "resize_targets": False}),
    ("RandAugment", {"severity": 9, "depth": 2, "augmentation_set": "all"}),
    ("SAM", {"rho": 0.05, "epsilon": 1e-12, "interval": 1}),
    ("SelectiveBackprop", {"start": 0.5, "end": 0.9, "keep": 0.5, "scale_factor": 0.5, "interrupt": 2}),
    ("SeqLengthWarmup", {"max_seq_length": 64}),
    ("SqueezeExcite", {"min_channels": 128, "latent_channels": 64}),
    ("StochasticDepth", {"target_layer_name": "ResNetBottleneck", "stochastic_method": "sample", "drop_rate": 0.2,
                         "drop_distribution": "linear"}),
    ("SWA", {"swa_start": "1ep", "swa_end": "2ep", "update_interval": "5ba"}),
    ("WeightStandardization", {"n_last_layers_ignore": 0}),
    ("EarlyStopper", {"monitor": "MulticlassAccuracy", "dataloader_label": "my_evaluator", "patience": 1}),
    ("ThresholdStopper", {"monitor": "MulticlassAccuracy", "dataloader_label": "my_evaluator", "threshold": 0.7}),
    ("SpeedMonitor", {"window_size": 100}),
    ("ActivationMonitor", {}),
    ("MemoryMonitor", {}),
    ("LRMonitor", {}),
    ("OptimizerMonitor", {}),
    ("RuntimeEstimator", {}),
    ("SystemMetricsMonitor", {}),
    ("ImageVisualizer", {}),
]

# Defaults that differ on purpose: (class, argument) -> (our default, why). Each is in the class's card or
# docstring and in docs/migrating-from-composer.md.
DELIBERATE = {
    ("ImageVisualizer", "channels_last"): (True, "JAX images are NHWC (flax convs); Composer's False means NCHW"),
}


def lookup(name: str) -> type:
    for module in (algorithms_module, callbacks_module):
        if hasattr(module, name):
            return getattr(module, name)
    raise AssertionError(f"composerjax has no {name} (Composer has one)")


def composer_kwargs(name: str) -> dict[str, object]:
    return {argument: REQUIRED_VALUES[argument] if default is REQUIRED else default
            for argument, default in COMPOSER_SIGNATURES[name].items()}


@pytest.mark.parametrize("name", sorted(COMPOSER_SIGNATURES))
def test_every_composer_argument_is_accepted_with_composers_default(name):
    cls = lookup(name)
    parameters = inspect.signature(cls).parameters
    for argument, default in COMPOSER_SIGNATURES[name].items():
        assert argument in parameters, f"{name} lacks Composer's argument {argument!r}"
        if default is REQUIRED or (name, argument) in DELIBERATE:
            continue
        ours = parameters[argument].default
        assert ours is not inspect.Parameter.empty, f"{name}({argument}) has no default; Composer's is {default!r}"
        assert ours == default and type(ours) is type(default), (
            f"{name}({argument}) defaults to {ours!r}; Composer's default is {default!r}")
    cls(**composer_kwargs(name))


@pytest.mark.parametrize("name, kwargs", DOC_EXAMPLES, ids=[name for name, _ in DOC_EXAMPLES])
def test_composer_documentation_examples_construct(name, kwargs):
    instance = lookup(name)(**kwargs)
    for argument, value in kwargs.items():
        stored = getattr(instance, argument, value)
        if isinstance(stored, (bool, int, float, str)) and isinstance(value, (bool, int, float, str)):
            assert stored == value, f"{name}.{argument} is {stored!r} after passing {value!r}"


@pytest.mark.parametrize("name, argument", sorted(DELIBERATE))
def test_deliberate_defaults_are_the_documented_ones(name, argument):
    assert inspect.signature(lookup(name)).parameters[argument].default == DELIBERATE[name, argument][0]


def test_checkpoint_saver_takes_composers_arguments(tmp_path):
    composer_defaults = {"folder": "{run_name}/checkpoints", "save_interval": "1ep", "overwrite": False,
                         "num_checkpoints_to_keep": -1, "weights_only": False, "ignore_keys": None,
                         "num_concurrent_uploads": 1, "upload_timeout_in_seconds": 3600}
    parameters = inspect.signature(CheckpointSaver).parameters
    for argument, default in composer_defaults.items():
        assert parameters[argument].default == default, argument
    for argument in ("filename", "remote_file_name", "latest_filename", "latest_remote_file_name"):
        assert argument in parameters
    saver = CheckpointSaver(folder=str(tmp_path / "{run_name}/checkpoints"), filename="ep{epoch}-ba{batch}",
                            remote_file_name="{run_name}/checkpoints/ep{epoch}-ba{batch}",
                            latest_filename="latest", save_interval="1ep", overwrite=False,
                            num_checkpoints_to_keep=-1, weights_only=False, ignore_keys=None,
                            num_concurrent_uploads=1, upload_timeout_in_seconds=3600)
    assert saver.weights_only is False
    with pytest.raises(ValueError, match=r"ignore_keys=\['state/model/\*'\].*load_ignore_keys"):
        CheckpointSaver(str(tmp_path), ignore_keys=["state/model/*"])


#: Built-in algorithms that Composer does not have (LoRA: Composer leaves it to PEFT through HuggingFaceModel).
BEYOND_COMPOSER = {"LoRA"}


def test_every_composer_algorithm_is_registered_and_nothing_else():
    from composerjax import registry

    ours = {registry.algorithms.get(name).__name__ for name in registry.algorithms.names()}
    composers = {name for name in COMPOSER_SIGNATURES if hasattr(algorithms_module, name)}
    assert ours - BEYOND_COMPOSER == composers and len(composers) == 28  # the README's count
    assert ours & BEYOND_COMPOSER == BEYOND_COMPOSER
