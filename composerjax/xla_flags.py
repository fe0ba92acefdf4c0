"""XLA's GPU options for training, set in one place: appended to ``XLA_FLAGS`` before JAX starts its GPU backend.

``import composerjax`` calls :func:`apply_gpu_xla_flags`, which appends :data:`GPU_XLA_FLAGS` to
the ``XLA_FLAGS`` environment variable when JAX is going to run on an NVIDIA GPU and its backend
has not started yet (XLA reads ``XLA_FLAGS`` once, when the backend starts; importing composerjax
starts none). On CPU or TPU nothing changes. A flag the user already put in ``XLA_FLAGS``, with
whatever value, wins: ours of the same name is left out.

Turning them off:

* before the process starts: ``COMPOSERJAX_XLA_GPU_FLAGS=0`` (also ``false``, ``off``, ``no``);
* from Python, after ``import composerjax`` and before the first JAX computation:
  :func:`remove_gpu_xla_flags` takes back exactly what was appended.

The flags come from MaxText's GPU training scripts (``docs/run_maxtext/run_maxtext_single_host_gpu.md``
and ``configs/gpu/a3/*/1vm.sh``), the subset that changes how XLA schedules work and which GEMM
library runs, not what is computed: no dtype, precision or algorithm changes. They are **not
measured here** (no GPU was at hand when they were chosen): ``benchmarks/lm.py --xla-gpu-flags on|off``
measures them, run once with each. Each name is checked against the installed jaxlib by a test
(XLA aborts the process on a flag it does not know).

Example:
    >>> from composerjax import xla_flags
    >>> xla_flags.flag_name("--xla_gpu_enable_triton_gemm=false")
    'xla_gpu_enable_triton_gemm'
    >>> xla_flags.apply_gpu_xla_flags({"JAX_PLATFORMS": "cpu"})  # nothing on CPU
    ()
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import MutableMapping

__all__ = ["ENV_SWITCH", "GPU_XLA_FLAGS", "apply_gpu_xla_flags", "appended_gpu_xla_flags", "flag_name",
           "gpu_platform_requested", "remove_gpu_xla_flags"]

#: The environment variable that turns the flags off: ``0``, ``false``, ``off`` or ``no``.
ENV_SWITCH = "COMPOSERJAX_XLA_GPU_FLAGS"

#: The flags, as MaxText writes them for single-host GPU training. Left out on purpose, though MaxText
#: sets them: ``--xla_gpu_enable_command_buffer=''`` (it turns CUDA graphs off, which save kernel
#: launches on one GPU running a small model), the collective pipelining and
#: ``--xla_gpu_enable_while_loop_double_buffering`` (more memory in scanned layers), and
#: ``--xla_disable_hlo_passes=rematerialization`` (a step that fits only with XLA's
#: rematerialisation would run out of memory).
GPU_XLA_FLAGS: tuple[str, ...] = (
    # Overlap asynchronous work (collectives, copies) with compute when ordering the kernels.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # cuBLAS / cuBLASLt for the matmuls instead of Triton-generated GEMMs: the same matmul in the
    # same dtypes (a different kernel may round differently, as any two GEMM kernels do).
    "--xla_gpu_enable_triton_gemm=false",
    # Run the asynchronous collectives' stream at the highest priority, so they are not starved.
    "--xla_gpu_enable_highest_priority_async_stream=true",
    # Combine small collectives into large ones (several GPUs: the data-parallel gradient all-reduce).
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
)

_OFF = ("0", "false", "off", "no")
_ON = ("", "1", "true", "on", "yes")
_GPU_PLATFORMS = ("cuda", "gpu")
_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
_NAME = re.compile(r"^--?([A-Za-z0-9_]+)")
_appended: tuple[str, ...] = ()  # what apply_gpu_xla_flags put in XLA_FLAGS in this process


def flag_name(flag: str) -> str:
    """The name of one ``XLA_FLAGS`` entry: ``'--xla_foo=1'`` -> ``'xla_foo'`` (``''`` for a word that is no flag).

    Example:
        >>> flag_name("--xla_gpu_all_reduce_combine_threshold_bytes=1")
        'xla_gpu_all_reduce_combine_threshold_bytes'
    """
    match = _NAME.match(flag)
    return match.group(1) if match else ""


def _cuda_plugin_installed() -> bool:
    for name in _CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def _nvidia_driver_present() -> bool:
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def gpu_platform_requested(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether JAX will start on an NVIDIA GPU, decided without starting it.

    ``JAX_PLATFORMS`` (or ``jax.config.jax_platforms`` once jax is imported) decides when set:
    its first platform is ``cuda`` or ``gpu``. Unset, JAX prefers a GPU when it can use one: a
    CUDA plugin is installed, the NVIDIA driver is loaded and ``CUDA_VISIBLE_DEVICES`` hides no
    device.

    Example:
        >>> gpu_platform_requested({"JAX_PLATFORMS": "cuda,cpu"}), gpu_platform_requested({"JAX_PLATFORMS": "cpu"})
        (True, False)
    """
    if environ is None:
        environ = os.environ
        platforms = sys.modules["jax"].config.jax_platforms if "jax" in sys.modules else None
        platforms = platforms or environ.get("JAX_PLATFORMS")
    else:
        platforms = environ.get("JAX_PLATFORMS")
    if platforms:
        return platforms.split(",")[0].strip().lower() in _GPU_PLATFORMS
    if environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    return _cuda_plugin_installed() and _nvidia_driver_present()


def _backend_started() -> bool:
    """Whether JAX already started a backend (it has read ``XLA_FLAGS``); never starts one."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - JAX moved it: assume not started
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else False


def _switch(environ: MutableMapping[str, str]) -> bool:
    value = environ.get(ENV_SWITCH, "1")
    if value.strip().lower() in _OFF:
        return False
    if value.strip().lower() in _ON:
        return True
    raise ValueError(f"{ENV_SWITCH}={value!r}: expected 1, true, on or yes (the GPU flags on) or 0, false, off or "
                     "no (off)")


def apply_gpu_xla_flags(environ: MutableMapping[str, str] | None = None, *, enabled: bool | None = None
                        ) -> tuple[str, ...]:
    """Append :data:`GPU_XLA_FLAGS` to ``XLA_FLAGS`` for a GPU run; returns the flags appended (``()``: none).

    Nothing is appended when ``enabled`` is False (None: ``$COMPOSERJAX_XLA_GPU_FLAGS`` decides,
    on unless 0/false/off/no), when JAX will not run on a GPU (:func:`gpu_platform_requested`),
    or when its backend has already started (it would not read them any more). A flag whose name
    ``XLA_FLAGS`` already holds keeps the user's value. Calling it again appends nothing new.

    Args:
        environ: the environment to read and change; ``os.environ`` by default.
        enabled: True or False overrides ``$COMPOSERJAX_XLA_GPU_FLAGS``.

    Raises:
        ValueError: ``$COMPOSERJAX_XLA_GPU_FLAGS`` holds something else, named with the accepted values.

    Example:
        >>> env = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
        >>> added = apply_gpu_xla_flags(env)
        >>> "--xla_gpu_enable_latency_hiding_scheduler=true" in added, env["XLA_FLAGS"].count("triton_gemm")
        (True, 1)
    """
    global _appended
    live = environ is None
    environ = os.environ if environ is None else environ
    switched_on = _switch(environ) if enabled is None else bool(enabled)
    if not switched_on or not gpu_platform_requested(None if live else environ):
        return ()
    if live and _backend_started():
        return ()
    existing = environ.get("XLA_FLAGS", "")
    present = {flag_name(word) for word in existing.split()}
    added = tuple(flag for flag in GPU_XLA_FLAGS if flag_name(flag) not in present)
    if added:
        environ["XLA_FLAGS"] = " ".join([existing.strip(), *added]).strip()
    if live:
        _appended = _appended + added
    return added


def appended_gpu_xla_flags() -> tuple[str, ...]:
    """The flags :func:`apply_gpu_xla_flags` appended to this process's ``XLA_FLAGS`` (and not removed since).

    Example:
        >>> isinstance(appended_gpu_xla_flags(), tuple)
        True
    """
    return _appended


def remove_gpu_xla_flags() -> tuple[str, ...]:
    """Take the flags that ``import composerjax`` appended back out of ``XLA_FLAGS``; returns them.

    The Python off switch: call it after ``import composerjax`` and before the first JAX
    computation. The user's own flags stay.

    Raises:
        RuntimeError: JAX's backend has already started with the flags (set
            ``COMPOSERJAX_XLA_GPU_FLAGS=0`` before the process starts instead).

    Example:
        >>> import composerjax
        >>> from composerjax.xla_flags import remove_gpu_xla_flags
        >>> removed = remove_gpu_xla_flags()  # () on a machine where none were appended
    """
    global _appended
    if not _appended:
        return ()
    if _backend_started():
        raise RuntimeError(f"remove_gpu_xla_flags(): JAX's backend already started with XLA_FLAGS holding "
                           f"{' '.join(_appended)}; set {ENV_SWITCH}=0 before the process starts instead")
    words = os.environ.get("XLA_FLAGS", "").split()
    removed, _appended = _appended, ()
    os.environ["XLA_FLAGS"] = " ".join(word for word in words if word not in removed)
    return removed
