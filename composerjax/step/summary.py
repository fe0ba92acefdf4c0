"""What a run compiles and holds: compiled-step records and the run summary printed at FIT_START."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import jax
import numpy as np

__all__ = ["CompiledStep", "cost_of", "costs_of", "memory_of", "parameter_summary", "format_summary"]


@dataclass
class CompiledStep:
    """One compiled step variant: which step, for which algorithms and inputs, and what it costs.

    Attributes:
        kind: 'train', 'eval' or 'predict'.
        algorithms: trace keys of the plan it was compiled for (``'MixUp/BEFORE_FORWARD'``...).
        batch_shapes: the shapes of the batch leaves it was compiled for.
        compile_seconds: wall time of the call that traced and compiled it.
        flops: floating-point operations per call from XLA's cost analysis (None if unavailable).
        bytes_accessed: bytes the call reads and writes, from the same analysis (None if unavailable).
        memory: the compiled executable's memory analysis in bytes (argument, output, temp, ...).
        batch: the training batch index at which it was compiled.
        from_cache: its executable came from the persistent compilation cache (traced, not compiled).
        attention: which attention kernel its trace chose and why (``'xla (cpu: no fused attention
            kernel)'``), from :func:`composerjax.models.attention.take_attention_choices`; None without attention.
    """

    kind: str
    algorithms: tuple[str, ...]
    batch_shapes: tuple[tuple[int, ...], ...]
    compile_seconds: float
    flops: float | None = None
    bytes_accessed: float | None = None
    memory: dict[str, int] = field(default_factory=dict)
    batch: int = 0
    from_cache: bool = False
    attention: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable view."""
        return asdict(self)


def cost_of(jitted: Any, *args: Any) -> float | None:
    """FLOPs per call of ``jitted`` on ``args`` (shapes suffice), from the compiled executable's cost analysis.

    Free once that variant has run (the executable is cached, in memory or on disk), where the
    lowered module's analysis would convert it to HLO again.
    """
    return costs_of(jitted, *args)[0]


def costs_of(jitted: Any, *args: Any) -> tuple[float | None, float | None]:
    """``(flops, bytes accessed)`` per call of ``jitted`` on ``args``, as :func:`cost_of` (None: unavailable)."""
    try:
        cost = jitted.lower(*args).compile().cost_analysis()
    except Exception:  # cost analysis is best effort: some backends do not provide it
        return None, None
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if not cost:
        return None, None
    flops, moved = cost.get("flops"), cost.get("bytes accessed")
    return (float(flops) if flops is not None and flops >= 0 else None,
            float(moved) if moved is not None and moved >= 0 else None)


def memory_of(jitted: Any, *args: Any) -> dict[str, int]:
    """The memory analysis of ``jitted``'s executable for ``args``: free once that variant has run."""
    try:
        stats = jitted.lower(*args).compile().memory_analysis()
    except Exception:  # best effort, as above
        return {}
    if stats is None:
        return {}
    names = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
             "generated_code_size_in_bytes")
    return {name.removesuffix("_in_bytes"): int(getattr(stats, name)) for name in names if hasattr(stats, name)}


def parameter_summary(params: Any) -> dict[str, int]:
    """Parameter count and bytes of a parameter pytree."""
    leaves = jax.tree.leaves(params)
    return {
        "parameters": int(sum(np.prod(leaf.shape) for leaf in leaves)),
        "parameter_bytes": int(sum(np.prod(leaf.shape) * leaf.dtype.itemsize for leaf in leaves)),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The run summary as a few readable lines."""
    lines = [f"run summary: {summary.get('run_name', '')}"]
    lines.append(f"  parameters: {summary['parameters']:,} ({summary['parameter_bytes'] / 2**20:.2f} MiB)")
    lines.append(f"  devices: {summary['devices']} ({summary['platform']}), precision {summary['precision']}, "
                 f"algorithms: {', '.join(summary['algorithms']) or 'none'}")
    cache = summary.get("compilation_cache")
    lines.append(f"  compilation cache: {cache['folder']}" if cache else "  compilation cache: off")
    if summary.get("grouping_blocked_by"):
        lines.append(f"  steps_per_call={summary['steps_per_call']['given']}: grouping blocked by "
                     f"{', '.join(summary['grouping_blocked_by'])} (they act between batches)")
    # Known only once training ran (fit end): the summary printed at FIT_START has neither.
    if summary.get("nonfinite_loss"):
        lines.append(f"  non-finite loss: {summary['nonfinite_loss']['message']}")
    if summary.get("skipped_nonfinite_updates"):
        lines.append(f"  {skipped_updates_line(summary['skipped_nonfinite_updates'])}")
    return "\n".join(lines)


def skipped_updates_line(entry: dict[str, int]) -> str:
    """The run summary's ``skipped_nonfinite_updates`` entry as a line.

    Example:
        >>> skipped_updates_line({"skipped": 3, "updates": 30})
        'skip_nonfinite_updates skipped 3 of 30 updates (NaN or infinite loss or gradients); their batches still count'
    """
    return (f"skip_nonfinite_updates skipped {entry['skipped']} of {entry['updates']} updates (NaN or infinite loss "
            "or gradients); their batches still count")


def format_compiled(step: CompiledStep) -> str:
    """One compiled step variant as a line."""
    flops = f", {step.flops:.4g} FLOPs" if step.flops is not None else ""
    temp = step.memory.get("temp_size")
    memory = f", temp {temp / 2**20:.2f} MiB" if temp is not None else ""
    attention = f", attention {step.attention}" if step.attention else ""
    plan = ", ".join(step.algorithms) or "no algorithms"
    how = "loaded from the compilation cache" if step.from_cache else "compiled"
    return (f"{how} {step.kind} step at batch {step.batch} in {step.compile_seconds:.2f}s{flops}{memory}{attention} "
            f"({plan})")
