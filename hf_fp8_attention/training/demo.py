"""The main job: train one small model three times — sdpa, fp8_stale, fp8_delta — side by side.

Same initial weights, same batches, same schedule; only ``attn_implementation`` differs. Prints a
table (final train loss, held-out loss, tokens/s, zero-row-sum residual) and saves the curves.
tokens/s is the median training step's throughput after warm-up (see ``loop.train``): one slow
step on a shared machine does not move it.

The residual column replays the run's own FP8 recipe backward (``diagnostics.diagnose``) on the
trained model's real post-RoPE q/k/v and real upstream gradient dO of every attention layer, on
one held-out batch: the median over query rows of |Σ_j dS_ij| / Σ_j P_ij|dP_ij|. The exact softmax
gradient has 0; Delta-Matching keeps it at fp32 rounding; the stale delta does not.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .corpus import load_corpus
from .data import group_texts, split_train_eval
from .errors import UsageError
from .loop import blocks_tensor, evaluate, train
from .models import ATTN_CHOICES, build_model, check_seq_len, tiny_config
from .plotting import plot_loss_curves
from .residual import row_sum_residuals
from .tokenizer import train_tokenizer


@dataclass
class DemoSettings:
    """One demo run. ``for_device`` picks the GPU default or the tiny CPU setting."""

    steps: int
    seq_len: int
    batch_size: int
    size: str
    vocab_size: int
    corpus_bytes: int | None
    lr: float
    family: str = "llama"
    attns: tuple = ATTN_CHOICES[::-1]  # sdpa, fp8_stale, fp8_delta
    seed: int = 0
    eval_batches: int = 4

    @classmethod
    def for_device(cls, device: torch.device, tiny: bool = False) -> "DemoSettings":
        if device.type == "cuda" and not tiny:
            # ~29M params, 300 steps x 16 x 1024 tokens on the whole stdlib corpus.
            return cls(steps=300, seq_len=1024, batch_size=16, size="small", vocab_size=8192,
                       corpus_bytes=None, lr=1e-3)
        return cls(steps=40, seq_len=64, batch_size=8, size="tiny", vocab_size=2048,
                   corpus_bytes=1_500_000, lr=2e-3)


def run_demo(settings: DemoSettings, out_dir: str | Path, device: torch.device, progress: bool = True) -> dict:
    """Train the three runs, write ``loss_curves.png`` and ``summary.json`` under ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for attn in settings.attns:
        if attn not in ATTN_CHOICES:
            raise UsageError(f"--attns: {attn!r} is not one of {', '.join(ATTN_CHOICES)}")
    corpus = load_corpus(max_bytes=settings.corpus_bytes)
    tokenizer = train_tokenizer(corpus, settings.vocab_size, show_progress=progress)
    blocks = group_texts(corpus, tokenizer, settings.seq_len)
    train_ds, eval_ds = split_train_eval(blocks, min_eval=settings.eval_batches * settings.batch_size)
    train_blocks, eval_blocks = blocks_tensor(train_ds), blocks_tensor(eval_ds)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    results, curves = {}, {}
    for attn in settings.attns:
        config = tiny_config(settings.family, settings.size, vocab_size=len(tokenizer),
                             max_position_embeddings=settings.seq_len, tokenizer=tokenizer)
        check_seq_len(config, settings.seq_len)
        model = build_model(config, attn, seed=settings.seed).to(device)
        log = train(model, train_blocks, steps=settings.steps, batch_size=settings.batch_size, lr=settings.lr,
                    device=device, autocast_dtype=autocast, seed=settings.seed, desc=attn, progress=progress)
        eval_loss = evaluate(model, eval_blocks, batch_size=settings.batch_size, device=device, autocast_dtype=autocast)
        residual = None
        if attn != "sdpa":  # sdpa's backward is exact: no recipe to replay
            probe = eval_blocks[: min(2, len(eval_blocks))].to(device)
            residual = row_sum_residuals(model, probe, attn)["median"]
        tail = log["loss"][-max(1, settings.steps // 10):]
        results[attn] = {"final_train_loss": sum(tail) / len(tail), "eval_loss": eval_loss,
                         "tokens_per_s": log["tokens_per_s"], "tokens_per_s_note": TOKENS_PER_S_NOTE,
                         "row_sum_residual_median": residual,
                         "n_params": sum(p.numel() for p in model.parameters())}
        curves[attn] = (log["steps"], log["loss"])
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    png = plot_loss_curves(curves, out_dir / "loss_curves.png", smooth=max(1, settings.steps // 20),
                           reference="sdpa" if "sdpa" in curves else None,
                           title=f"demo: {settings.family}-{settings.size}, seq {settings.seq_len}")
    summary = {"settings": asdict(settings), "device": str(device), "results": results, "plot": str(png),
               "curves": {k: v[1] for k, v in curves.items()}}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


TOKENS_PER_S_NOTE = ("tokens/s: training tokens (forward + backward + optimizer step) per second of the median "
                     "timed step, warm-up steps excluded; the median resists a busy machine.")


def format_table(summary: dict) -> str:
    """The demo's result table as aligned text."""
    head = f"{'attention':<10} {'train loss':>10} {'eval loss':>10} {'tokens/s (median step)':>22} {'row-sum residual':>17}"
    lines = [head, "-" * len(head)]
    for attn, r in summary["results"].items():
        res = "— (exact)" if r["row_sum_residual_median"] is None else f"{r['row_sum_residual_median']:.2e}"
        tps = r["tokens_per_s"]
        lines.append(f"{attn:<10} {r['final_train_loss']:>10.4f} {r['eval_loss']:>10.4f} "
                     f"{(f'{tps:,.0f}' if math.isfinite(tps) else 'n/a'):>22} {res:>17}")
    return "\n".join(lines)
