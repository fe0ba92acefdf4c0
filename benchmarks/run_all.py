"""Run every benchmark and write their tables to ``benchmarks/RESULTS.md`` (``make bench``).

Each script runs in its own process (the scaling benchmark sets its simulated device count before
JAX starts), one after another so they never share the machine's cores. The file records the date,
the machine and the library versions next to the tables, so figures can be compared run to run.
Sections of the existing file that this run does not produce (the before/after records written by
hand, and benchmarks left out with ``--only``) are kept where they were.

Run: ``.venv/bin/python benchmarks/run_all.py [--only overhead,checkpoint] [--output PATH]``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# (script, arguments, what it shows)
BENCHMARKS = [
    ("overhead.py", [], "Engine overhead against a hand-written jax.jit + optax loop"),
    ("steps_per_call.py", [], "Several batches per compiled call (steps_per_call) against hand-written loops"),
    ("algorithms.py", [], "Per-algorithm step-time ratio and compile count"),
    ("time_to_accuracy.py", [], "Time to the baseline's accuracy on digits, median of three seeds"),
    ("checkpoint.py", [], "Async checkpoint overhead, save and restore cost"),
    ("scaling.py", [], "Data-parallel and FSDP overhead on simulated devices"),
    ("lm.py", [], "A real language-model job: GPT-2 on the Python standard library's source"),
    ("fast_defaults.py", [], "Fast defaults against hand loops: auto grouping, prefetch, eval, memory, warm starts"),
    ("auto_fresh.py", [], "steps_per_call='auto' in fresh processes on a busy machine: one choice, and its speed"),
]


def machine() -> str:
    import flax
    import jax
    import optax
    import orbax.checkpoint

    cpu = platform.processor() or platform.machine()
    return (f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} cores; Python "
            f"{platform.python_version()}; jax {jax.__version__} ({jax.devices()[0].platform}), flax "
            f"{flax.__version__}, optax {optax.__version__}, orbax-checkpoint "
            f"{getattr(orbax.checkpoint, '__version__', '?')}")


def previous_sections(path: str) -> list[str]:
    """The ``## `` sections of the results file already at ``path`` (none if there is no file)."""
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        text = handle.read()
    parts = text.split("\n## ")[1:]
    return ["## " + part.rstrip("\n") + "\n" for part in parts]


def merge(previous: list[str], fresh: list[str]) -> list[str]:
    """``previous`` with each section that ``fresh`` has a section of the same title for replaced, new ones last.

    Example:
        >>> merge(["## a\\n\\nold\\n", "## kept\\n"], ["## a\\n\\nnew\\n", "## b\\n"])
        ['## a\\n\\nnew\\n', '## kept\\n', '## b\\n']
    """
    title = lambda section: section.split("\n", 1)[0]  # noqa: E731
    by_title = {title(section): section for section in fresh}
    merged = [by_title.pop(title(section), section) for section in previous]
    return merged + [section for section in fresh if title(section) in by_title]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="", help="comma-separated script names without .py")
    parser.add_argument("--output", default=os.path.join(HERE, "RESULTS.md"))
    args = parser.parse_args()
    chosen = [b for b in BENCHMARKS if not args.only or b[0].removesuffix(".py") in args.only.split(",")]
    sections = []
    for script, extra, title in chosen:
        print(f"== {script}", flush=True)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, os.path.join(HERE, script), *extra], capture_output=True, text=True)
        seconds = time.perf_counter() - start
        output = "\n".join(line for line in done.stdout.splitlines() if not line.startswith("WARNING"))
        status = "" if done.returncode == 0 else f"\n\n**failed with exit status {done.returncode}:**\n\n```\n" + (
            done.stderr[-2000:] + "\n```")
        print(output, flush=True)
        sections.append(f"## {title}\n\n`benchmarks/{script}` ({seconds:.0f} s)\n\n```text\n{output}\n```{status}\n")
    header = (f"# Benchmark results\n\nWritten by `make bench` on {datetime.date.today().isoformat()}.\n\n"
              f"Machine: {machine()}.\n\nEvery figure is a ratio measured side by side in one process. Absolute "
              "times on a shared machine are not results.\n")
    with open(args.output, "w") as handle:
        handle.write(header + "\n" + "\n".join(merge(previous_sections(args.output), sections)))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
