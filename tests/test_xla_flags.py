"""XLA's GPU options: ``import composerjax`` appends them to XLA_FLAGS for a GPU run only; the user's flags win.

XLA reads ``XLA_FLAGS`` when JAX's backend starts, so each case runs ``import composerjax`` in a
fresh process with the environment it describes and reads back the variable (no GPU is needed:
nothing starts the backend). ``JAX_PLATFORMS=cuda`` is how a user pins JAX to the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from composerjax import xla_flags
from composerjax.xla_flags import GPU_XLA_FLAGS, apply_gpu_xla_flags, flag_name, gpu_platform_requested

REPORT = ("import json, os, sys, composerjax\n"
          "from jax._src import xla_bridge\n"
          "print(json.dumps({'XLA_FLAGS': os.environ.get('XLA_FLAGS'),"
          " 'started': xla_bridge.backends_are_initialized(),"
          " 'appended': list(composerjax.xla_flags.appended_gpu_xla_flags())}))\n")


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {key: value for key, value in os.environ.items()
               if key not in ("XLA_FLAGS", "JAX_PLATFORMS", xla_flags.ENV_SWITCH)}
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=300)


def report(**env: str) -> dict:
    done = run_python(REPORT, **env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_appends_the_flags_for_a_gpu_run_without_starting_the_backend():
    seen = report(JAX_PLATFORMS="cuda")
    assert seen == {"XLA_FLAGS": " ".join(GPU_XLA_FLAGS), "started": False, "appended": list(GPU_XLA_FLAGS)}


def test_nothing_is_appended_on_cpu():
    assert report(JAX_PLATFORMS="cpu") == {"XLA_FLAGS": None, "started": False, "appended": []}
    assert report(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_cpu_enable_fast_math=false")["XLA_FLAGS"] == (
        "--xla_cpu_enable_fast_math=false")


def test_a_flag_the_user_set_keeps_the_users_value():
    seen = report(JAX_PLATFORMS="cuda", XLA_FLAGS="--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/hlo")
    others = [flag for flag in GPU_XLA_FLAGS if flag_name(flag) != "xla_gpu_enable_triton_gemm"]
    assert seen["XLA_FLAGS"] == " ".join(["--xla_gpu_enable_triton_gemm=true", "--xla_dump_to=/tmp/hlo", *others])
    assert seen["appended"] == others


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_the_environment_switch_turns_them_off(value):
    assert report(JAX_PLATFORMS="cuda", COMPOSERJAX_XLA_GPU_FLAGS=value) == {"XLA_FLAGS": None, "started": False,
                                                                              "appended": []}


def test_a_bad_switch_value_is_refused_naming_it():
    done = run_python("import composerjax", JAX_PLATFORMS="cuda", COMPOSERJAX_XLA_GPU_FLAGS="maybe")
    assert done.returncode != 0
    assert ("ValueError: COMPOSERJAX_XLA_GPU_FLAGS='maybe': expected 1, true, on or yes (the GPU flags on) or 0, "
            "false, off or no (off)") in done.stderr


def test_remove_gpu_xla_flags_is_the_python_off_switch():
    code = ("import os, composerjax\nfrom composerjax.xla_flags import remove_gpu_xla_flags\n"
            "removed = remove_gpu_xla_flags()\nprint(len(removed), repr(os.environ['XLA_FLAGS']), "
            "remove_gpu_xla_flags())\n")
    done = run_python(code, JAX_PLATFORMS="cuda", XLA_FLAGS="--xla_dump_to=/tmp/hlo")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{len(GPU_XLA_FLAGS)} '--xla_dump_to=/tmp/hlo' ()"


def test_too_late_once_the_backend_started():
    # The backend starts on CPU; then the platform setting says GPU: the flags could no longer be read.
    code = ("import jax, os\njax.numpy.ones(1).block_until_ready()\njax.config.update('jax_platforms', 'cuda')\n"
            "from composerjax.xla_flags import apply_gpu_xla_flags, gpu_platform_requested\n"
            "print(gpu_platform_requested(), apply_gpu_xla_flags(), os.environ.get('XLA_FLAGS'))\n")
    done = run_python(code, JAX_PLATFORMS="cpu")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True () None"


def test_remove_after_the_backend_started_says_to_use_the_environment(monkeypatch):
    monkeypatch.setattr(xla_flags, "_appended", ("--xla_gpu_enable_triton_gemm=false",))
    monkeypatch.setattr(xla_flags, "_backend_started", lambda: True)
    with pytest.raises(RuntimeError, match="COMPOSERJAX_XLA_GPU_FLAGS=0 before the process starts"):
        xla_flags.remove_gpu_xla_flags()


def test_every_flag_is_one_the_installed_xla_knows():
    # XLA aborts on a flag it does not know: the same jaxlib parses the GPU flags on CPU.
    code = "import jax\nprint(float(jax.numpy.ones(3).sum()))"
    assert run_python(code, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(GPU_XLA_FLAGS)).stdout.strip() == "3.0"
    unknown = run_python(code, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_gpu_pipeline_all_gather=on")
    assert unknown.returncode != 0 and "Unknown flag in XLA_FLAGS" in unknown.stderr


def test_the_platform_is_decided_from_the_setting_or_the_machine(monkeypatch):
    assert [gpu_platform_requested({"JAX_PLATFORMS": value}) for value in ("cuda", "gpu,cpu", "cpu,cuda", "tpu")] == [
        True, True, False, False]
    for plugin, driver, expected in ((True, True, True), (True, False, False), (False, True, False)):
        monkeypatch.setattr(xla_flags, "_cuda_plugin_installed", lambda plugin=plugin: plugin)
        monkeypatch.setattr(xla_flags, "_nvidia_driver_present", lambda driver=driver: driver)
        assert gpu_platform_requested({}) is expected
    monkeypatch.setattr(xla_flags, "_cuda_plugin_installed", lambda: True)
    monkeypatch.setattr(xla_flags, "_nvidia_driver_present", lambda: True)
    assert gpu_platform_requested({"CUDA_VISIBLE_DEVICES": "0"}) is True
    assert gpu_platform_requested({"CUDA_VISIBLE_DEVICES": ""}) is False  # no device shown


def test_apply_on_a_given_environment_and_the_enabled_override():
    env = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": " --xla_gpu_enable_latency_hiding_scheduler=false "}
    added = apply_gpu_xla_flags(env)
    assert added == GPU_XLA_FLAGS[1:] and env["XLA_FLAGS"].split() == [
        "--xla_gpu_enable_latency_hiding_scheduler=false", *GPU_XLA_FLAGS[1:]]
    assert apply_gpu_xla_flags(env) == ()  # a second call adds nothing
    assert apply_gpu_xla_flags({"JAX_PLATFORMS": "cuda"}, enabled=False) == ()
    assert apply_gpu_xla_flags({"JAX_PLATFORMS": "cuda", xla_flags.ENV_SWITCH: "0"}, enabled=True) == GPU_XLA_FLAGS
