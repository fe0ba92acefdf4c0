"""A real language-model job: GPT-2 on the Python standard library's source, byte-level BPE (issue 18).

Four measurements in one run:

1. **Engine overhead.** ``Trainer.fit`` against the strongest hand-written JAX loop (plain-dict
   parameters, numpy batches into one donated ``jax.jit`` step, optax clip + adamw with the same
   cosine-with-warmup schedule), same model, batches and precision; interleaved rounds after a
   warm-up pass whose last losses must agree. Tokens/s of both and engine / hand (target >= 0.97).
   Where ``torch`` imports, PyTorch races in the same rounds (``--torch``, ``lm_torch.py``): the
   same GPT-2 by hand under ``torch.compile`` (and eager), and Composer's ``Trainer`` with
   ``compile_config={}`` where ``composer`` imports; their rows and the ``engine/row`` ratios sit in
   the same table, and one line says why a side skipped.
2. **FLOP/s and MFU.** XLA's FLOPs of each compiled step and the model's ``6N + attention``
   FLOPs per token, times the measured rate; MFU against the GPU's dense bf16 peak.
3. **Time to a target validation loss**, median of the seeds: the baseline, and Composer's LLM
   recipe made of the library's algorithms that apply to GPT-2. The target is the baseline's
   median final validation loss. Wall time counts training only (evaluation and the compiles of
   each train-step variant are excluded and the compile seconds printed apart).
4. **Peak memory per device** of the compiled train step (argument + output + temp − aliased),
   per precision, compiled only.
5. **The lean step** (``--lean MEMORY,COMPILE``, off by default): the peak memory of the ``amp_bf16``
   train step of the ``MEMORY`` preset on the whole batch's logits (the step before the chunked
   loss), with the default chunked loss, and with ``remat='dots'`` and ``'full'``; then the compile
   time of the ``COMPILE`` preset's step unrolled and with ``scan_layers=True`` (the persistent
   compilation cache off). Compiled from shapes only, nothing runs.

Run: ``.venv/bin/python benchmarks/lm.py [--quick] [--config gpt2-small] [--plot PATH]``.
``--quick`` is a smoke test (about 2 minutes on 2 CPU cores), the default about 10 minutes on 2
cores, ``--config gpt2-small`` the 124M model at 1024 tokens for an accelerator. Part 5 alone:
``.venv/bin/python benchmarks/lm.py --skip race,loss,memory --lean gpt2-small,gpt2-medium --lean-batch 8x1024``
(``--lean gpt2-tiny,gpt2-tiny --lean-batch 2x64`` is its smoke test). ``--xla-gpu-flags on|off``
keeps or takes out ``composerjax.xla_flags.GPU_XLA_FLAGS`` (run once with each to measure them). The
PyTorch side's smoke test on CPU: ``--config gpt2-tiny --skip loss,memory --race-batches 2 --race-rounds 1
--batch-size 4 --max-files 20``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lm_steps import (  # noqa: E402
    PRECISIONS,
    EngineRun,
    HandRun,
    HandStep,
    Job,
    engine_trainer,
    peak_flops,
    step_costs,
)

from composerjax import Callback  # noqa: E402
from composerjax import algorithms as alg  # noqa: E402
from composerjax.data.lm import stdlib_lm  # noqa: E402
from composerjax.models.gpt2 import GPT2, GPT2Config  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class Profile:
    """How big the job is and how long each part of the benchmark runs."""

    job: Job
    data_vocab: int  # the tokenizer's; the model's vocab_size may be larger (GPT-2's 50257)
    max_files: int | None  # None: the whole standard library
    race_batches: int  # per round
    race_rounds: int
    budget: int  # batches per time-to-loss run
    eval_every: int
    eval_batches: int
    warmup_step: int = 32  # SeqLengthWarmup's min_seq_length and step_size: one compiled step per length
    seeds: tuple[int, ...] = (0, 1, 2)
    memory_extra: tuple[tuple[str, Job], ...] = ()  # other models to compile for the memory table


def _tiny(**fields: Any) -> GPT2Config:
    return GPT2Config.preset("gpt2-tiny", **fields)


SMALL = GPT2Config.preset("gpt2-small", dropout=0.0, attention_dropout=0.0)
PROFILES = {
    "quick": Profile(Job(_tiny(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2), 64, 8),
                     data_vocab=512, max_files=150, race_batches=4, race_rounds=3, budget=30, eval_every=10,
                     eval_batches=4),
    "gpt2-tiny": Profile(Job(_tiny(vocab_size=2048, n_positions=128, n_embd=128, n_layer=2, n_head=4), 128, 16),
                         data_vocab=2048, max_files=None, race_batches=8, race_rounds=12, budget=200, eval_every=25,
                         eval_batches=8, memory_extra=(("gpt2-small: d768 L12, b8", Job(SMALL, 1024, 8)),)),
    "gpt2-small": Profile(Job(SMALL, 1024, 16, lr=6e-4), data_vocab=8192, max_files=None, race_batches=20,
                          race_rounds=10, budget=400, eval_every=25, eval_batches=16, warmup_step=256),
}


def llm_recipe(profile: Profile, precision: str) -> list[Any]:
    """Composer's LLM speed-up algorithms: ALiBi (full-length batches), GLU, sequence-length warmup (+ LPLN)."""
    step, length = profile.warmup_step, profile.job.seq_len
    recipe: list[Any] = [alg.Alibi(max_sequence_length=length, train_sequence_length_scaling=1.0),
                         alg.GatedLinearUnits(),
                         alg.SeqLengthWarmup(duration=0.3, min_seq_length=step, max_seq_length=length,
                                             step_size=step)]
    if precision != "fp32":  # LowPrecisionLayerNorm follows the run's precision: in fp32 it changes nothing
        recipe.append(alg.LowPrecisionLayerNorm())
    return recipe


RECIPES: dict[str, Callable[[Profile, str], list[Any]]] = {"baseline": lambda profile, precision: [],
                                                           "llm": llm_recipe}


def applicable(config: GPT2Config) -> str:
    """How many modules each model-surgery algorithm of the LLM recipe replaces in GPT-2."""
    counts = {}
    for name, surgery in (("ALiBi", lambda m: alg.apply_alibi(m, config.n_positions)),
                          ("GatedLinearUnits", alg.apply_gated_linear_units),
                          ("LowPrecisionLayerNorm", lambda m: alg.apply_low_precision_layernorm(m, "amp_bf16"))):
        counts[name] = surgery(GPT2(config, rngs=nnx.Rngs(0)))
    return ", ".join(f"{name} replaces {count}" for name, count in counts.items())


# -- 1 and 2: engine against the hand loop, FLOP/s, MFU --------------------------------------------
def flops_text(value: float | None) -> str:
    if value is None:
        return "n/a"
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e6:.3g} MFLOP/s"


def race_all(contenders: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Interleaved rounds of every contender's ``run()``, the order rotating each round; tokens/s per round."""
    names = list(contenders)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            rates[name].append(contenders[name].run())
    return rates


def engine_ratios(rates: dict[str, list[float]]) -> dict[str, float]:
    """Engine / each contender as total tokens over total time (harmonic means of equal-token rounds' rates)."""
    engine = statistics.harmonic_mean(rates["engine"])
    return {name: engine / statistics.harmonic_mean(values) for name, values in rates.items()}


def throughput(profile: Profile, batches: list[Any], precisions: list[str], torch_loops: list[str] = (),
               torch_side: Any = None) -> list[dict[str, Any]]:
    """Parts 1-2: the engine, the hand-written JAX step and the PyTorch loops (``torch_side``: lm_torch), one race."""
    job, device = profile.job, jax.devices()[0]
    peak = peak_flops(device)
    torch_loops = list(torch_loops) if torch_side is not None else []
    others = f" and PyTorch ({', '.join(torch_loops)})" if torch_loops else ""
    print(f"\n== 1-2. Engine against a hand-written jax.jit + optax loop{others}: {profile.race_rounds} interleaved "
          f"rounds of {profile.race_batches} batches after a warm-up pass; tokens/s are medians, engine/row is total "
          f"tokens over total time (target >= 0.97 against hand)")
    print(f"model FLOPs/token (6N + attention) {job.model_flops_per_step / job.tokens_per_step:,.0f}; peak "
          + (f"{flops_text(peak)} dense bf16 ({device.device_kind})" if peak else
             ("n/a on CPU" if device.platform == "cpu" else f"unknown for {device.device_kind}")))
    if torch_loops:
        print("PyTorch rows: peak MiB is torch.cuda.max_memory_allocated over the warm-up (n/a on CPU); XLA columns "
              "n/a; MFU on the same 6N + attention FLOPs and peak")
    print(f"{'precision':10s} {'loop':22s} {'tokens/s':>10s} {'XLA GFLOP/step':>15s} {'XLA FLOP/s':>14s} "
          f"{'model FLOP/s':>14s} {'MFU':>7s} {'peak MiB':>9s} {'warm-up loss':>13s} {'engine/row':>11s}")
    rows = []
    for precision in precisions:
        contenders: dict[str, Any] = {"hand": HandRun(job, batches, precision),
                                      "engine": EngineRun(job, batches, precision)}
        skipped: list[str] = []
        if torch_loops:
            runs, skipped = torch_side.torch_runs(job, batches, precision, torch_loops)
            contenders.update(runs)
        rates = race_all(contenders, profile.race_rounds)
        ratios = engine_ratios(rates)
        first = len(rows)
        for loop, run in contenders.items():
            rate = statistics.median(rates[loop])
            steps = rate / job.tokens_per_step
            costs = run.costs if hasattr(run, "costs") else {"flops": None, "peak_bytes": run.peak_bytes}
            xla = costs["flops"] * steps if costs["flops"] else None
            model = job.model_flops_per_step * steps
            mfu = f"{model / peak:7.1%}" if peak else f"{'n/a':>7s}"
            xla_per_step = f"{costs['flops'] / 1e9:15.2f}" if costs["flops"] else f"{'n/a':>15s}"
            memory = f"{costs['peak_bytes'] / 2**20:9.1f}" if costs["peak_bytes"] else f"{'n/a':>9s}"
            print(f"{precision:10s} {loop:22s} {rate:10.0f} {xla_per_step} {flops_text(xla):>14s} "
                  f"{flops_text(model):>14s} {mfu} {memory} {run.warmup_loss:13.6f} {ratios[loop]:11.3f}")
            rows.append({"precision": precision, "loop": loop, "tokens/s": rate, "mfu": model / peak if peak else None,
                         "xla_flops": xla, "model_flops": model, "peak_bytes": costs["peak_bytes"],
                         "engine/row": ratios[loop]})
        engine_row = next(row for row in rows[first:] if row["loop"] == "engine")
        hand_row = next(row for row in rows[first:] if row["loop"] == "hand")
        engine_row.update(ratio=ratios["hand"], hand_mfu=hand_row["mfu"], hand_tokens=hand_row["tokens/s"],
                          torch={name: ratios[name] for name in contenders if name not in ("hand", "engine")},
                          torch_skipped=skipped)
        engine = contenders["engine"]
        versus = "".join(f"; engine/{name} {ratios[name]:.3f}" for name in contenders if name not in ("hand", "engine"))
        difference = abs(engine.warmup_loss - contenders["hand"].warmup_loss)
        print(f"{precision:10s} engine/hand {ratios['hand']:.3f}{versus}; compiles "
              f"{engine.trainer.state.compile_count}; warm-up loss difference {difference:.2e}", flush=True)
        for line in skipped:
            print(line)
        del contenders, engine
        if torch_loops:
            torch_side.release_memory()  # the next precision's JAX steps get the GPU memory PyTorch cached
    if peak is None:
        print("MFU: n/a on CPU" if device.platform == "cpu" else f"MFU: no peak listed for {device.device_kind}")
    return rows


# -- 3: time to the baseline's validation loss ----------------------------------------------------
class LossCurve(Callback):
    """Records ``(training seconds, tokens, validation loss)`` at each evaluation.

    Training seconds run from FIT_START and leave out every evaluation and each batch that
    compiled a train-step variant (its trace, compile, first dispatch and the engine's cost and
    memory analysis of it), which ``compile_seconds`` adds up.
    """

    def __init__(self) -> None:
        self.points: list[tuple[float, int, float]] = []
        self.start = self.evaluating = self.eval_seconds = self.compile_seconds = self.batch_began = 0.0
        self.compiles = 0

    def fit_start(self, state: Any, logger: Any) -> None:
        self.start, self.eval_seconds, self.compile_seconds, self.points = time.perf_counter(), 0.0, 0.0, []

    def batch_start(self, state: Any, logger: Any) -> None:
        self.batch_began, self.compiles = time.perf_counter(), state.compile_count

    def batch_end(self, state: Any, logger: Any) -> None:
        if state.compile_count != self.compiles:
            self.compile_seconds += time.perf_counter() - self.batch_began

    def eval_start(self, state: Any, logger: Any) -> None:
        jax.block_until_ready(state.train_state)  # the train steps in flight belong to training
        self.evaluating = time.perf_counter()

    def eval_end(self, state: Any, logger: Any) -> None:
        seconds = self.evaluating - self.start - self.eval_seconds - self.compile_seconds
        loss = float(state.metrics["eval"]["LanguageCrossEntropy"])
        self.points.append((seconds, state.timestamp.counts.token, loss))
        self.eval_seconds += time.perf_counter() - self.evaluating


def loss_curve(profile: Profile, train: Any, evaluation: list[Any], recipe: str, precision: str,
               seed: int) -> dict[str, Any]:
    curve = LossCurve()
    train.set_epoch(0)  # every run reads the same batches in the same order (the loader keeps its position)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SeqLengthWarmup's note on recompiles: counted below
        trainer = engine_trainer(profile.job, train, profile.budget, precision, seed,
                                 RECIPES[recipe](profile, precision), eval_dataloader=evaluation,
                                 eval_interval=f"{profile.eval_every}ba", callbacks=[curve])
        trainer.fit()
    compiled = [step for step in trainer.state.compiled_steps if step.kind == "train"]
    return {"points": curve.points, "compiles": len(compiled), "compile_seconds": curve.compile_seconds}


def reach(points: list[tuple[float, int, float]], target: float) -> tuple[float, float]:
    """``(seconds, tokens)`` at the first evaluation at or below ``target``; ``(inf, inf)`` if none."""
    return next(((s, t) for s, t, loss in points if loss <= target + 1e-9), (math.inf, math.inf))


def time_to_loss(profile: Profile, train: Any, evaluation: list[Any], precision: str,
                 plot: str | None) -> dict[str, dict[str, Any]]:
    job = profile.job
    print(f"\n== 3. Time to the baseline's validation loss: {profile.budget} batches per run, evaluated every "
          f"{profile.eval_every} on {len(evaluation)} held-out batches, seeds {list(profile.seeds)} (model "
          f"initialisation; the data order is fixed), precision {precision}")
    print(f"surgery on GPT-2: {applicable(job.config)}")
    for name in RECIPES:
        algorithms = ", ".join(repr(a) for a in RECIPES[name](profile, precision)) or "none"
        print(f"  {name}: GradientClipping + {algorithms}")
    runs = {name: [] for name in RECIPES}
    for seed in profile.seeds:
        for name in RECIPES:  # interleaved per seed, so machine noise hits the recipes alike
            runs[name].append(loss_curve(profile, train, evaluation, name, precision, seed))
            print(f"  seed {seed} {name:9s} final loss {runs[name][-1]['points'][-1][2]:.4f}", flush=True)
    target = statistics.median(run["points"][-1][2] for run in runs["baseline"])
    print(f"target = baseline's median final validation loss {target:.4f}")
    print(f"{'recipe':10s} {'reached':>8s} {'median s to target':>19s} {'median tokens':>14s} "
          f"{'median final loss':>18s} {'s for budget':>13s} {'compiles':>9s} {'compile s':>10s}")
    summary = {}
    for name, seeds in runs.items():
        reached = [reach(run["points"], target) for run in seeds]
        seconds = statistics.median(s for s, _ in reached)
        tokens = statistics.median(t for _, t in reached)
        count = sum(math.isfinite(s) for s, _ in reached)
        finals = statistics.median(run["points"][-1][2] for run in seeds)
        total = statistics.median(run["points"][-1][0] for run in seeds)
        when = f"{seconds:19.1f}" if math.isfinite(seconds) else f"{'not reached':>19s}"
        many = f"{tokens:14,.0f}" if math.isfinite(tokens) else f"{'not reached':>14s}"
        print(f"{name:10s} {count:>5d}/{len(seeds)} {when} {many} {finals:18.4f} {total:13.1f} "
              f"{statistics.median(run['compiles'] for run in seeds):9.0f} "
              f"{statistics.median(run['compile_seconds'] for run in seeds):10.1f}")
        summary[name] = {"seconds": seconds, "tokens": tokens, "reached": f"{count}/{len(seeds)}", "final": finals}
    base = summary["baseline"]
    for name, row in summary.items():
        if name == "baseline":
            continue
        if math.isfinite(row["seconds"]):
            print(f"{name}: {base['seconds'] / row['seconds']:.2f}x the baseline's speed to the target, "
                  f"{row['tokens'] / base['tokens']:.2f}x its tokens")
        else:
            print(f"{name}: the median seed does not reach the target within {profile.budget} batches")
    if plot:
        draw(runs, target, plot, f"{job.describe().split(';')[0]}, {precision}")
        print(f"plot: {plot}")
    return summary


def draw(runs: dict[str, list[dict[str, Any]]], target: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for (name, seeds), color in zip(runs.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        for run in seeds:
            seconds, _, losses = zip(*run["points"])
            axes.plot(seconds, losses, color=color, alpha=0.3, linewidth=0.8)
        length = min(len(run["points"]) for run in seeds)
        median = [(statistics.median(run["points"][i][0] for run in seeds),
                   statistics.median(run["points"][i][2] for run in seeds)) for i in range(length)]
        axes.plot(*zip(*median), color=color, linewidth=2, marker="o", markersize=3, label=f"{name} (median)")
    axes.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.3f}")
    axes.set_xlabel("training wall time, s (evaluation and compiles excluded)")
    axes.set_ylabel("validation cross-entropy")
    axes.set_title(title, fontsize=9)
    axes.legend()
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


# -- 4: peak memory of the compiled step ----------------------------------------------------------
def memory(profile: Profile, label: str, race: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    print("\n== 4. Peak memory per device of the compiled train step (argument + output + temp - aliased), "
          "the hand-written step compiled from shapes (not run); the engine's own step where part 1 ran it")
    print(f"{'model':34s} {'precision':10s} {'peak MiB':>10s} {'engine MiB':>11s} {'XLA GFLOP/step':>15s} "
          f"{'compile s':>10s}")
    engine = {row["precision"]: row["peak_bytes"] for row in race if row["loop"] == "engine"}
    table: dict[str, dict[str, float]] = {}
    for index, (name, job) in enumerate(((label, profile.job), *profile.memory_extra)):
        for precision in PRECISIONS:
            start = time.perf_counter()
            costs = step_costs(HandStep(job, precision, total_steps=100, abstract=True).lower().compile())
            flops = f"{costs['flops'] / 1e9:15.1f}" if costs["flops"] else f"{'n/a':>15s}"
            ours = engine.get(precision) if index == 0 else None
            ours_text = f"{ours / 2**20:11.1f}" if ours else f"{'-':>11s}"
            print(f"{name:34s} {precision:10s} {costs['peak_bytes'] / 2**20:10.1f} {ours_text} {flops} "
                  f"{time.perf_counter() - start:10.1f}", flush=True)
            table.setdefault(name, {})[precision] = costs["peak_bytes"]
    return table


# -- 5: the lean step: chunked loss, remat, scanned layers ----------------------------------------
def lean(memory_preset: str, compile_preset: str, batch: int, seq_len: int) -> dict[str, float]:
    """Peak memory of the amp_bf16 step per loss and remat choice; compile seconds unrolled against scanned."""
    from composerjax.step.compile_cache import enable_compilation_cache

    print(f"\n== 5. The lean step: peak memory per device of the amp_bf16 train step (argument + output + temp - "
          f"aliased), {memory_preset} at batch {batch}x{seq_len}, compiled from shapes (the hand-written step, "
          "whose loss is the model's, as the engine's)")
    print(f"{'variant':34s} {'peak MiB':>10s} {'temp MiB':>10s} {'compile s':>10s}")
    base = GPT2Config.preset(memory_preset, dropout=0.0, attention_dropout=0.0)
    results: dict[str, float] = {}
    for name, config, whole in (("whole batch's logits (before)", base, True), ("default (chunked loss)", base, False),
                                ("remat='dots'", dataclasses.replace(base, remat="dots"), False),
                                ("remat='full'", dataclasses.replace(base, remat="full"), False)):
        start = time.perf_counter()
        compiled = HandStep(Job(config, seq_len, batch), "amp_bf16", total_steps=100, abstract=True,
                            whole_logits=whole).lower().compile()
        peak, temp = step_costs(compiled)["peak_bytes"], compiled.memory_analysis().temp_size_in_bytes
        results[name] = peak
        seconds = time.perf_counter() - start
        print(f"{name:34s} {peak / 2**20:10.1f} {temp / 2**20:10.1f} {seconds:10.1f}", flush=True)
    before, default, full = (results[name] for name in ("whole batch's logits (before)", "default (chunked loss)",
                                                         "remat='full'"))
    print(f"default / before {default / before:.3f} (target <= 0.8); remat='full' / default {full / default:.3f} "
          "(target <= 0.333)")
    cache = enable_compilation_cache(False)
    print(f"\ncompile time of the {compile_preset} amp_bf16 step at batch {batch}x{seq_len}, persistent compilation "
          f"cache {'kept on (set by the user: ' + cache + ')' if cache else 'off'}")
    print(f"{'layers':10s} {'trace + lower s':>16s} {'compile s':>10s} {'total s':>8s}")
    for scan in (False, True):
        config = GPT2Config.preset(compile_preset, dropout=0.0, attention_dropout=0.0, scan_layers=scan)
        start = time.perf_counter()
        lowered = HandStep(Job(config, seq_len, batch), "amp_bf16", total_steps=100, abstract=True).lower()
        traced = time.perf_counter() - start
        lowered.compile()
        total = time.perf_counter() - start
        name = "scanned" if scan else "unrolled"
        results[name] = total
        print(f"{name:10s} {traced:16.1f} {total - traced:10.1f} {total:8.1f}", flush=True)
    print(f"scanned / unrolled compile time {results['scanned'] / results['unrolled']:.3f} (target <= 0.5)")
    return results


def torch_loops(text: str) -> list[str]:
    """``--torch``'s value as a list of loops from ``lm_torch.LOOPS`` (``'none'``: an empty list)."""
    accepted = ("compile", "eager", "composer")
    loops = [] if text.strip() == "none" else [loop.strip() for loop in text.split(",") if loop.strip()]
    wrong = [loop for loop in loops if loop not in accepted]
    if wrong:
        raise argparse.ArgumentTypeError(f"--torch {text!r}: {', '.join(wrong)} unknown; expected a comma-separated "
                                         f"list of {', '.join(accepted)}, or none")
    return loops


def import_torch_side() -> tuple[Any, str | None]:
    """``(lm_torch, None)`` where torch imports, else ``(None, the one line saying why the PyTorch side skipped)``."""
    try:
        import torch  # noqa: F401
    except ImportError as error:
        return None, f"PyTorch side skipped: torch does not import ({type(error).__name__}: {error})"
    import lm_torch

    return lm_torch, None


def xla_gpu_flags(setting: str, torch_too: bool) -> None:
    """``--xla-gpu-flags``: take composerjax's GPU flags out of XLA_FLAGS, or put them in; before JAX starts.

    With PyTorch on the same GPU, JAX must not take 75% of its memory up front: preallocation off
    (unless the user set it).
    """
    from composerjax import xla_flags

    if setting == "off":
        xla_flags.remove_gpu_xla_flags()
    else:
        xla_flags.apply_gpu_xla_flags(enabled=True)
    if torch_too:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny budgets: a smoke test of every part")
    parser.add_argument("--config", default="gpt2-tiny", choices=["gpt2-tiny", "gpt2-small"])
    parser.add_argument("--precisions", default="fp32,amp_bf16", help="for the engine/hand race")
    parser.add_argument("--precision", default=None, help="for time to loss (default: amp_bf16 on GPU, else fp32)")
    parser.add_argument("--plot", default=os.path.join(HERE, "lm_time_to_loss.png"))
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: race, loss, memory")
    parser.add_argument("--lean", default=None, metavar="MEMORY,COMPILE",
                        help="part 5 (off by default): the presets for the memory table and the compile times, e.g. "
                             "gpt2-small,gpt2-medium")
    parser.add_argument("--lean-batch", default="8x1024", metavar="BxT", help="part 5's batch (default 8x1024)")
    parser.add_argument("--torch", default="compile,composer", type=torch_loops, metavar="LOOPS",
                        help="the PyTorch loops beside the engine in parts 1-2, comma-separated from compile, eager, "
                             "composer, or none (default compile,composer); they run where torch imports")
    parser.add_argument("--xla-gpu-flags", default="on", choices=["on", "off"],
                        help="composerjax.xla_flags.GPU_XLA_FLAGS in XLA_FLAGS on a GPU (default on): run once with "
                             "each to measure them")
    parser.add_argument("--race-batches", type=int, default=None, help="batches per race round (default: profile's)")
    parser.add_argument("--race-rounds", type=int, default=None, help="race rounds (default: the profile's)")
    parser.add_argument("--batch-size", type=int, default=None, help="the job's batch size (default: the profile's)")
    parser.add_argument("--max-files", type=int, default=None, help="stdlib files for the data (default: profile's)")
    args = parser.parse_args()
    profile = PROFILES["quick" if args.quick else args.config]
    overrides = {name: getattr(args, name) for name in ("race_batches", "race_rounds", "max_files")
                 if getattr(args, name) is not None}
    if args.batch_size is not None:
        overrides["job"] = dataclasses.replace(profile.job, batch_size=args.batch_size)
    profile = dataclasses.replace(profile, **overrides)
    job = profile.job
    torch_side, torch_skip = import_torch_side() if args.torch else (None, "PyTorch side skipped: --torch none")
    xla_gpu_flags(args.xla_gpu_flags, torch_side is not None)
    label = f"{'quick' if args.quick else args.config}: d{job.config.n_embd} L{job.config.n_layer}, b{job.batch_size}"
    device = jax.devices()[0]
    precision = args.precision or ("amp_bf16" if device.platform == "gpu" else "fp32")
    skip = set(filter(None, args.skip.split(",")))
    started = time.perf_counter()
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind}), {len(jax.devices())} device(s); "
          f"profile {label}")
    print(f"job: {profile.job.describe()}")
    print(torch_skip or f"PyTorch side: torch {torch_side.torch.__version__} on {torch_side.torch_device()}, loops "
          f"{', '.join(args.torch)}")
    print(f"--xla-gpu-flags {args.xla_gpu_flags}; XLA_FLAGS: {os.environ.get('XLA_FLAGS') or '(empty)'}; "
          f"XLA_PYTHON_CLIENT_PREALLOCATE: {os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE', '(unset)')}")
    results: dict[str, Any] = {}
    if {"race", "loss"} - skip:
        data, race_batches, evaluation = load_data(profile)
    if "race" not in skip:
        results["race"] = throughput(profile, race_batches, args.precisions.split(","), args.torch, torch_side)
    if "loss" not in skip:
        results["loss"] = time_to_loss(profile, data.train, evaluation, precision, args.plot)
    if "memory" not in skip:
        results["memory"] = memory(profile, label, results.get("race", []))
    if args.lean:
        memory_preset, _, compile_preset = args.lean.partition(",")
        batch, _, seq_len = args.lean_batch.partition("x")
        results["lean"] = lean(memory_preset, compile_preset or memory_preset, int(batch), int(seq_len))
    summarise(results, precision, time.perf_counter() - started)


def load_data(profile: Profile) -> tuple[Any, list[Any], list[Any]]:
    """The stdlib data for ``profile``: the splits, the race's batches and the evaluation batches."""
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        data = stdlib_lm(seq_len=profile.job.seq_len, batch_size=profile.job.batch_size,
                         vocab_size=profile.data_vocab, seed=0, max_files=profile.max_files,
                         tokenizer_path=os.path.join(folder, "tokenizer.json"))
        print(f"data: Python stdlib source, BPE vocab {profile.data_vocab}, {len(data.train)} train batches "
              f"({len(data.train) * profile.job.tokens_per_step:,} tokens), {len(data.eval)} eval batches; built in "
              f"{time.perf_counter() - start:.1f} s")
    data.train.set_epoch(0)
    batches = iter(data.train)
    race_batches = [next(batches) for _ in range(profile.race_batches)]
    evaluation = [batch for _, batch in zip(range(profile.eval_batches), data.eval)]
    return data, race_batches, evaluation


def summarise(results: dict[str, Any], precision: str, seconds: float) -> None:
    print(f"\n== Summary ({seconds:.0f} s)")
    for row in results.get("race", []):
        if "ratio" in row:
            mfu = f", MFU engine {row['mfu']:.1%} hand {row['hand_mfu']:.1%}" if row["mfu"] is not None else ""
            print(f"throughput {row['precision']:9s} tokens/s engine {row['tokens/s']:.0f} hand "
                  f"{row['hand_tokens']:.0f}, engine/hand {row['ratio']:.3f}; engine {flops_text(row['xla_flops'])} "
                  f"(XLA), {flops_text(row['model_flops'])} (6N + attention){mfu}"
                  + "".join(f"; engine/{name} {ratio:.3f}" for name, ratio in row.get("torch", {}).items()))
    for name, row in results.get("loss", {}).items():
        when = f"{row['seconds']:.1f} s, {row['tokens']:,.0f} tokens" if math.isfinite(row["seconds"]) else (
            "not reached")
        print(f"time to target ({precision}) {name:9s} {when} (reached {row['reached']}, final {row['final']:.4f})")
    for name, table in results.get("memory", {}).items():
        print(f"peak memory {name}: " + ", ".join(f"{p} {b / 2**20:.1f} MiB" for p, b in table.items()))
    lean_results = results.get("lean")
    if lean_results:
        print("lean step: " + ", ".join(f"{name} {value / 2**20:.1f} MiB" for name, value in lean_results.items()
                                        if name not in ("unrolled", "scanned"))
              + f"; compile unrolled {lean_results['unrolled']:.1f} s, scanned {lean_results['scanned']:.1f} s")


if __name__ == "__main__":
    main()
