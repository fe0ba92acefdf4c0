"""The PyTorch side of ``benchmarks/lm.py``: the same GPT-2 by hand in PyTorch, and Composer's ``Trainer`` on it.

:class:`TorchGPT2` has exactly the parameters of ``composerjax.models.gpt2.GPT2`` for the same
:class:`~composerjax.models.gpt2.GPT2Config`: the token embedding with **our padded vocabulary**
(``padded_vocab_size`` rows, 50,304 for GPT-2's 50,257; the padding rows start at zero and the
logits are sliced to ``vocab_size`` before the loss, as ours are), learned positions, pre-LN
blocks (LayerNorm, fused QKV projection, ``scaled_dot_product_attention(is_causal=True)``, output
projection; LayerNorm, MLP with GELU's tanh approximation), a final LayerNorm and the head tied to
the token embedding. Initialisation is GPT-2's (normal 0.02, residual projections scaled by
``1/sqrt(2·n_layer)``, zero biases).

:class:`TorchRun` is the hand-written loop a careful PyTorch user writes: the model under
``torch.compile`` (or eager), ``AdamW`` (fused on CUDA) with the job's betas, eps and decoupled
weight decay (PyTorch's ``weight_decay`` is multiplied by the rate: Composer's per-step decay
divided by the peak rate, as ``lm_steps.hand_optimizer`` does for optax), the same linear warmup
and cosine decay to ``alpha_f`` (a ``LambdaLR``), ``clip_grad_norm_(1.0)``, and the precisions of
``lm.py``: ``fp32`` (TF32 matmuls on CUDA, as XLA's default precision on GPU), ``amp_bf16``
(float32 weights under ``torch.autocast(bfloat16)``) and ``bf16`` (weights and Adam's moments in
bfloat16). :class:`ComposerRun` is the same model as a ``ComposerModel`` under Composer's
``Trainer(compile_config={})`` with Composer's ``DecoupledAdamW``, schedule and ``GradientClipping``:
it runs only where ``import composer`` works.
"""

from __future__ import annotations

import gc
import math
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from lm_steps import Job
from torch import nn

from composerjax.models.gpt2 import GPT2Config

_INIT_STD = 0.02
LOOPS = ("compile", "eager", "composer")


def torch_device() -> torch.device:
    """CUDA when PyTorch sees a GPU, else the CPU (the tiny config's smoke test)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Block(nn.Module):
    """Pre-LN block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        d = config.n_embd
        self.n_head = config.n_head
        self.norm1 = nn.LayerNorm(d, eps=config.layer_norm_epsilon)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, eps=config.layer_norm_epsilon)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, d = x.shape
        q, k, v = (t.view(batch, length, self.n_head, d // self.n_head).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(d, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, d))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class TorchGPT2(nn.Module):
    """GPT-2 in PyTorch with the parameters of ``GPT2(config)``: ``(B, T)`` tokens to ``(B, T, vocab_size)`` logits.

    Example:
        >>> model = TorchGPT2(GPT2Config.preset("gpt2-tiny"))
        >>> model(torch.zeros((2, 16), dtype=torch.long)).shape
        torch.Size([2, 16, 512])
    """

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        unsupported = {name: getattr(config, name) for name, default in
                       (("position", "learned"), ("tie_embeddings", True), ("dropout", 0.0), ("attention_dropout", 0.0))
                       if getattr(config, name) != default}
        if unsupported:
            raise ValueError(f"TorchGPT2: {unsupported} not written here; expected position='learned', "
                             "tie_embeddings=True, dropout=0 and attention_dropout=0 (the benchmark's model)")
        self.vocab_size = config.vocab_size
        self.tokens = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.position = nn.Embedding(config.n_positions, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        residual_std = _INIT_STD / math.sqrt(2 * config.n_layer)
        with torch.no_grad():
            for name, parameter in self.named_parameters():
                if name.endswith("bias"):
                    parameter.zero_()
                elif parameter.dim() == 2:  # embeddings and linear weights; LayerNorm scales stay at one
                    nn.init.normal_(parameter, std=residual_std if name.endswith(("proj.weight", "down.weight"))
                                    else _INIT_STD)
            self.tokens.weight[config.vocab_size:].zero_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.tokens.weight.t()
        return logits[..., : self.vocab_size]


def parameter_count(model: nn.Module) -> int:
    """The number of parameter elements of ``model`` (the tied head counted once, as PyTorch lists it once)."""
    return sum(parameter.numel() for parameter in model.parameters())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in float32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def lr_factor(job: Job, total_steps: int) -> Any:
    """The multiplier of the peak rate per step: linear warmup from 0, then cosine to ``alpha_f`` (optax's schedule)."""
    warmup = job.warmup_steps(total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return job.alpha_f + (1 - job.alpha_f) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def to_torch(batches: list[Any], device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The race's numpy ``(inputs, targets)`` batches as int64 CPU tensors (pinned when feeding a GPU)."""
    converted = []
    for batch in batches:
        pair = tuple(torch.from_numpy(np.asarray(part, dtype=np.int64)) for part in batch)
        converted.append(tuple(t.pin_memory() for t in pair) if device.type == "cuda" else pair)
    return converted


def release_memory() -> None:
    """Free what PyTorch's caching allocator holds from runs no longer referenced (on CUDA)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TorchStep:
    """One hand-written PyTorch training step for ``job`` at ``precision``; ``mode`` is ``'compile'`` or ``'eager'``."""

    def __init__(self, job: Job, precision: str, total_steps: int, mode: str = "compile", seed: int = 0,
                 device: torch.device | None = None) -> None:
        if mode not in ("compile", "eager"):
            raise ValueError(f"TorchStep(mode={mode!r}): expected 'compile' or 'eager'")
        if precision not in ("fp32", "amp_bf16", "bf16"):
            raise ValueError(f"TorchStep(precision={precision!r}): expected 'fp32', 'amp_bf16' or 'bf16'")
        self.job, self.precision, self.mode = job, precision, mode
        self.device = device or torch_device()
        torch.manual_seed(seed)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # XLA's default precision for float32 dots on GPU
            torch.backends.cudnn.allow_tf32 = True
        self.model = TorchGPT2(job.config).to(self.device)
        if precision == "bf16":
            self.model = self.model.to(torch.bfloat16)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=job.lr, betas=job.betas, eps=job.eps,
                                           weight_decay=job.weight_decay / job.lr,
                                           fused=self.device.type == "cuda")
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(job, total_steps))
        self.forward = torch.compile(self.model) if mode == "compile" else self.model
        self.fallback: str | None = None  # why torch.compile fell back to eager

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "amp_bf16"):
            return lm_loss(self.forward(inputs), targets)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = (t.to(self.device, non_blocking=True) for t in batch)
        try:
            loss = self.loss(inputs, targets)
        except Exception as error:  # inductor needs a C++ compiler (CPU) or Triton (GPU): say so, run eager
            if self.mode != "compile" or self.fallback is not None:
                raise
            self.fallback = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:160]
            self.forward = self.model
            loss = self.loss(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.job.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        return loss.detach()

    def label(self) -> str:
        if self.mode == "eager":
            return "torch eager"
        return "torch.compile" if self.fallback is None else "torch eager (fallback)"


class TorchRun:
    """A :class:`TorchStep` racing on the race's batches: a warm-up pass (compiles), then ``run()`` returns tokens/s."""

    def __init__(self, job: Job, batches: list[Any], precision: str, mode: str = "compile", seed: int = 0) -> None:
        self.job = job
        self.hand = TorchStep(job, precision, total_steps=len(batches), mode=mode, seed=seed)
        self.batches = to_torch(batches, self.hand.device)
        if self.hand.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.hand.device)
        self.warmup_loss = float(self.train())
        self.peak_bytes = (float(torch.cuda.max_memory_allocated(self.hand.device))
                           if self.hand.device.type == "cuda" else None)
        self.label = self.hand.label()

    def train(self) -> torch.Tensor:
        loss = None
        for batch in self.batches:
            loss = self.hand.step(batch)
        synchronize(self.hand.device)
        return loss

    def run(self) -> float:
        start = time.perf_counter()
        self.train()
        return len(self.batches) * self.job.tokens_per_step / (time.perf_counter() - start)


def composer_skip_reason(precision: str) -> str | None:
    """Why Composer's ``Trainer`` cannot run here at ``precision`` (None: it can)."""
    try:
        import composer  # noqa: F401
    except Exception as error:  # any failure to import is a reason to skip, printed as it is
        return f"import composer failed ({type(error).__name__}: {error})"
    if precision not in ("fp32", "amp_bf16"):
        return f"Composer has no precision {precision!r} (it has fp32, amp_fp16, amp_bf16, amp_fp8)"
    return None


class ComposerRun:
    """The same model and job under Composer's ``Trainer`` with ``compile_config={}``; ``run()`` fits one more pass.

    Mirrors ``lm_steps.EngineRun``: the first ``fit()`` (compile and warm-up) runs the whole
    schedule; each later ``fit(duration=...)`` extends it.
    """

    label = "Composer+compile"

    def __init__(self, job: Job, batches: list[Any], precision: str, seed: int = 0) -> None:
        from composer import ComposerModel, Trainer
        from composer.algorithms import GradientClipping
        from composer.optim import CosineAnnealingWithWarmupScheduler, DecoupledAdamW

        class ComposerGPT2(ComposerModel):
            def __init__(self, model: nn.Module) -> None:
                super().__init__()
                self.model = model

            def forward(self, batch: Any) -> torch.Tensor:
                return self.model(batch[0])

            def loss(self, outputs: torch.Tensor, batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
                return lm_loss(outputs, batch[1])

        self.job, self.batches = job, batches
        self.device = torch_device()
        torch.manual_seed(seed)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        model = ComposerGPT2(TorchGPT2(job.config))
        self.trainer = Trainer(
            model=model, train_dataloader=to_torch(batches, torch.device("cpu")), max_duration=f"{len(batches)}ba",
            optimizers=DecoupledAdamW(model.parameters(), lr=job.lr, betas=job.betas, eps=job.eps,
                                      weight_decay=job.weight_decay),
            schedulers=CosineAnnealingWithWarmupScheduler(t_warmup=f"{job.warmup_steps(len(batches))}ba",
                                                          alpha_f=job.alpha_f),
            algorithms=[GradientClipping(clipping_type="norm", clipping_threshold=job.clip)],
            precision=precision, device="gpu" if self.device.type == "cuda" else "cpu", compile_config={},
            seed=seed, progress_bar=False, log_to_console=False)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.trainer.fit()
        synchronize(self.device)
        self.warmup_loss = float(self.trainer.state.loss)
        self.peak_bytes = float(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else None

    def run(self) -> float:
        start = time.perf_counter()
        self.trainer.fit(duration=f"{len(self.batches)}ba")
        synchronize(self.device)
        return len(self.batches) * self.job.tokens_per_step / (time.perf_counter() - start)


def torch_runs(job: Job, batches: list[Any], precision: str, loops: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The PyTorch contenders for ``loops`` (from :data:`LOOPS`), warmed up; and one line per loop skipped."""
    runs: dict[str, Any] = {}
    skipped: list[str] = []
    for loop in loops:
        if loop == "composer":
            reason = composer_skip_reason(precision)
            if reason:
                skipped.append(f"{precision} Composer+compile skipped: {reason}")
                continue
            run = ComposerRun(job, batches, precision)
        else:
            run = TorchRun(job, batches, precision, mode=loop)
            if run.hand.fallback:
                skipped.append(f"{precision} torch.compile failed, ran eager instead: {run.hand.fallback}")
        runs[run.label] = run
    return runs, skipped
