"""benchmarks/lm.py: the PyTorch rows and the engine/row ratios beside the JAX rows; why the PyTorch side skipped.

Each case runs the benchmark in a fresh process, as a user does, kept small (2 batches of 4, one
round, part of the standard library). No timing is asserted: only what is printed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL_RACE = ["--config", "gpt2-tiny", "--skip", "loss,memory", "--precisions", "fp32", "--race-batches", "2",
              "--race-rounds", "1", "--batch-size", "4", "--max-files", "20"]


def run(code_or_args: list[str] | str, **env: str) -> subprocess.CompletedProcess:
    inherited = ("XLA_FLAGS", "JAX_PLATFORMS", "COMPOSERJAX_XLA_GPU_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE")
    environ = {key: value for key, value in os.environ.items() if key not in inherited}
    environ.update({"JAX_PLATFORMS": "cpu", **env})
    command = ([sys.executable, "-c", code_or_args] if isinstance(code_or_args, str)
               else [sys.executable, "benchmarks/lm.py", *code_or_args])
    return subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True, timeout=600)


def test_the_torch_rows_and_ratio_columns_sit_in_the_jax_table():
    done = run([*SMALL_RACE, "--torch", "compile,eager,composer"])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("PyTorch side: torch ") and line.endswith("on cpu, loops compile, eager, composer")
               for line in lines)
    header = next(line for line in lines if line.startswith("precision  loop"))
    assert header.split()[-1] == "engine/row"
    rows = {line[11:33].strip(): line.split() for line in lines[lines.index(header) + 1:]
            if line.startswith("fp32       ") and "engine/hand" not in line}
    # inductor compiles on this machine (a C++ compiler is installed), so no fallback label
    assert list(rows) == ["hand", "engine", "torch.compile", "torch eager"]
    for name, row in rows.items():
        line = next(line for line in lines if line.startswith(f"fp32       {name} "))
        assert len(line) == len(header), (line, header)  # one fixed-width table
        assert float(row[-1]) > 0 and float(row[-2]) > 0  # engine/row and the warm-up loss
    assert rows["engine"][-1] == "1.000"
    assert rows["torch.compile"][3:5] == ["n/a", "n/a"]  # no XLA FLOPs for PyTorch
    summary = next(line for line in lines if line.startswith("fp32       engine/hand "))
    assert "; engine/torch.compile " in summary and "; engine/torch eager " in summary
    assert float(summary.split("engine/torch.compile ")[1].split(";")[0]) == float(rows["torch.compile"][-1])
    assert ("fp32 Composer+compile skipped: import composer failed (ModuleNotFoundError: No module named "
            "'composer')") in lines


def test_without_torch_one_line_says_why_the_pytorch_side_skipped():
    code = ("import runpy, sys\nsys.modules['torch'] = None  # what a machine without torch gives\n"
            "sys.argv = ['benchmarks/lm.py', '--skip', 'race,loss,memory']\n"
            "runpy.run_path('benchmarks/lm.py', run_name='__main__')\n")
    done = run(code)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if "PyTorch" in line]
    assert said == ["PyTorch side skipped: torch does not import (ModuleNotFoundError: import of torch halted; None "
                    "in sys.modules)"]


def test_a_bad_torch_loop_is_refused_naming_it():
    done = run(["--torch", "compile,jit"])
    assert done.returncode == 2
    assert "--torch 'compile,jit': jit unknown; expected a comma-separated list of compile, eager, composer, or none" \
        in done.stderr


def test_xla_gpu_flags_on_and_off_before_jax_starts():
    code = ("import os, sys\nsys.path.insert(0, 'benchmarks')\nimport lm\n"
            "lm.xla_gpu_flags(sys.argv[1], torch_too=True)\n"
            "print(repr(os.environ.get('XLA_FLAGS')), os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'))\n")
    from composerjax.xla_flags import GPU_XLA_FLAGS

    off = run(code.replace("sys.argv[1]", "'off'"), JAX_PLATFORMS="cuda")
    assert off.returncode == 0, off.stderr[-3000:]
    assert off.stdout.split() == ["''", "false"]  # appended at import, taken back
    on = run(code.replace("sys.argv[1]", "'on'"), JAX_PLATFORMS="cuda", COMPOSERJAX_XLA_GPU_FLAGS="0")
    assert on.returncode == 0, on.stderr[-3000:]
    assert on.stdout.strip() == f"{' '.join(GPU_XLA_FLAGS)!r} false"  # the option wins over the variable
    cpu = run(code.replace("sys.argv[1]", "'on'"), XLA_PYTHON_CLIENT_PREALLOCATE="true")
    assert cpu.stdout.split() == ["None", "true"]  # nothing on CPU; the user's preallocation setting is kept


def import_lm():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import lm

    return lm


def test_the_race_rotates_the_order_and_the_ratios_are_total_tokens_over_total_time():
    lm = import_lm()
    calls = []

    class Contender:
        def __init__(self, name, rates):
            self.name, self.rates = name, iter(rates)

        def run(self):
            calls.append(self.name)
            return next(self.rates)

    rates = lm.race_all({"hand": Contender("hand", [100.0, 100.0, 100.0]),
                         "engine": Contender("engine", [110.0, 90.0, 99.0]),
                         "torch.compile": Contender("torch.compile", [50.0, 50.0, 50.0])}, rounds=3)
    assert calls == ["hand", "engine", "torch.compile", "engine", "torch.compile", "hand",
                     "torch.compile", "hand", "engine"]
    assert rates == {"hand": [100.0, 100.0, 100.0], "engine": [110.0, 90.0, 99.0],
                     "torch.compile": [50.0, 50.0, 50.0]}
    ratios = lm.engine_ratios(rates)
    engine = 3 / (1 / 110 + 1 / 99 + 1 / 90)  # three rounds of equal tokens: total tokens over total time
    assert ratios == {"hand": pytest.approx(engine / 100), "engine": 1.0, "torch.compile": pytest.approx(engine / 50)}
