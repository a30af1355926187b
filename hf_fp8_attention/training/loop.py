"""A minimal, fully explicit training loop used by ``demo`` and the notebooks.

The examples use Trainer and Accelerate; this loop exists so the side-by-side comparison runs the
three attention implementations on the same batches in one process with nothing hidden.
"""
from __future__ import annotations

import math
import statistics
import time

import torch


def blocks_tensor(ds) -> torch.Tensor:
    """``(N, S)`` int64 from a dataset of equal-length ``input_ids`` rows (see ``data.group_texts``)."""
    return torch.tensor(ds["input_ids"], dtype=torch.long)


_clock = time.perf_counter  # the step timer (a test replaces it)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model, blocks: torch.Tensor, *, batch_size: int, device, autocast_dtype=None) -> float:
    """Mean token loss over ``blocks (N, S)``."""
    device = torch.device(device)
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        ids = blocks[start:start + batch_size].to(device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(input_ids=ids, labels=ids).loss
        n = ids.numel() - ids.shape[0]
        total += float(loss) * n
        count += n
    model.train()
    return total / count


def train(model, train_blocks: torch.Tensor, *, steps: int, batch_size: int, lr: float, device,
          autocast_dtype=None, warmup: int | None = None, seed: int = 0, desc: str = "train",
          progress: bool = True) -> dict:
    """AdamW + linear warmup + cosine decay on batches drawn (seeded) from ``train_blocks``.

    Returns ``{"steps": [...], "loss": [...], "tokens_per_s": float, "seconds": float,
    "step_seconds": [...]}``. ``tokens_per_s`` is the batch's tokens over the MEDIAN step time of the
    steps after warm-up (the first ``warmup_steps_excluded(steps)``: allocator, kernel compilation):
    the mean would let one step stalled by another process swing it by tens of times on a shared
    machine. ``seconds``: wall time of the timed steps.
    """
    from tqdm import tqdm  # plain bar: tqdm.auto warns in notebooks without ipywidgets
    from transformers import get_cosine_schedule_with_warmup

    device = torch.device(device)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, steps // 10) if warmup is None else warmup
    sched = get_cosine_schedule_with_warmup(opt, warmup, steps)
    gen = torch.Generator().manual_seed(seed)
    losses, step_seconds, tokens_per_step = [], [], 0
    skip = warmup_steps_excluded(steps)
    bar = tqdm(range(steps), desc=desc, disable=not progress, dynamic_ncols=True)
    for step in bar:
        _sync(device)
        t0 = _clock()
        idx = torch.randint(len(train_blocks), (batch_size,), generator=gen)
        ids = train_blocks[idx].to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(input_ids=ids, labels=ids).loss
        if not math.isfinite(float(loss.detach())):
            raise FloatingPointError(f"{desc}: loss became {float(loss.detach())} at step {step}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        _sync(device)
        elapsed = _clock() - t0
        if step >= skip:
            step_seconds.append(elapsed)
            tokens_per_step = ids.numel()
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    median = statistics.median(step_seconds) if step_seconds else float("nan")
    return {"steps": list(range(1, steps + 1)), "loss": losses,
            "tokens_per_s": tokens_per_step / median if step_seconds else float("nan"),
            "seconds": sum(step_seconds) if step_seconds else float("nan"), "step_seconds": step_seconds}


def warmup_steps_excluded(steps: int) -> int:
    """Steps left out of the throughput: the first one, and up to 10% of the run (at most 5)."""
    return 0 if steps < 2 else min(steps - 1, max(1, min(5, steps // 10)))
