"""A minimal, fully explicit training loop used by ``demo`` and the notebooks.

The examples use Trainer and Accelerate; this loop exists so the side-by-side comparison runs the
three attention implementations on the same batches in one process with nothing hidden.
"""
from __future__ import annotations

import math
import time

import torch


def blocks_tensor(ds) -> torch.Tensor:
    """``(N, S)`` int64 from a dataset of equal-length ``input_ids`` rows (see ``data.group_texts``)."""
    return torch.tensor(ds["input_ids"], dtype=torch.long)


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

    Returns ``{"steps": [...], "loss": [...], "tokens_per_s": float, "seconds": float}``; the
    throughput excludes the first step (allocator and kernel warm-up).
    """
    from tqdm import tqdm  # plain bar: tqdm.auto warns in notebooks without ipywidgets
    from transformers import get_cosine_schedule_with_warmup

    device = torch.device(device)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, steps // 10) if warmup is None else warmup
    sched = get_cosine_schedule_with_warmup(opt, warmup, steps)
    gen = torch.Generator().manual_seed(seed)
    losses, timed_tokens, t0 = [], 0, None
    bar = tqdm(range(steps), desc=desc, disable=not progress, dynamic_ncols=True)
    for step in bar:
        if step == 1:
            _sync(device)
            t0 = time.perf_counter()
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
        if step >= 1:
            timed_tokens += ids.numel()
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    _sync(device)
    seconds = time.perf_counter() - t0 if t0 is not None else float("nan")
    return {"steps": list(range(1, steps + 1)), "loss": losses,
            "tokens_per_s": timed_tokens / seconds if steps > 1 else float("nan"), "seconds": seconds}
