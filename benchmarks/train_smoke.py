"""Train smoke test: a tiny byte-level Llama trained N steps with "sdpa" and then "fp8_delta".

Same seed, same initial weights, same batches. Data: the Python standard library's ``.py``
sources (real text present on every machine, no download), bytes as tokens (vocab 256).
Writes ``train_smoke.json`` (both loss curves + summary) and ``train_smoke.png`` under --out and
prints a summary. A smoke test that the FP8 backward trains, not the parity study.

``python benchmarks/train_smoke.py --steps 200 --out $OUT [--attn sdpa,fp8_delta,fp8_stale]``
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
from pathlib import Path

import torch


def stdlib_bytes(max_bytes: int) -> torch.Tensor:
    """uint8 tokens of the stdlib's .py files in a fixed order (up to max_bytes)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py"), key=lambda p: str(p)):
        if any(part in {"site-packages", "test", "tests", "idlelib", "__pycache__"} for part in path.parts):
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"no Python sources under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def build_model(attn: str, seed: int, seq_len: int, head_dim: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
        num_attention_heads=384 // head_dim, num_key_value_heads=2 if head_dim == 64 else 384 // head_dim,
        head_dim=head_dim, max_position_embeddings=seq_len, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation=attn)
    if model.config._attn_implementation != attn:
        raise RuntimeError(f"attention implementation {attn!r} was not applied ({model.config._attn_implementation!r})")
    return model


def train_one(attn: str, data: torch.Tensor, args, device) -> dict:
    model = build_model(attn, args.seed, args.seq_len, args.head_dim).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed + 1)  # same batches for every attention backend
    n_blocks = (data.numel() - 1) // args.seq_len
    eval_ids = torch.arange(n_blocks - args.eval_blocks, n_blocks)
    losses, t0 = [], time.time()
    model.train()
    for step in range(args.steps):
        idx = torch.randint(0, n_blocks - args.eval_blocks, (args.batch,), generator=gen)
        x = torch.stack([data[i * args.seq_len : (i + 1) * args.seq_len] for i in idx.tolist()]).to(device)
        lr = args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if not math.isfinite(losses[-1]):
            break
    torch.cuda.synchronize()
    elapsed = time.time() - t0
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        ev = [float(model(input_ids=data[i * args.seq_len : (i + 1) * args.seq_len][None].to(device),
                          labels=data[i * args.seq_len : (i + 1) * args.seq_len][None].to(device)).loss) for i in eval_ids.tolist()]
    return {"attn": attn, "losses": losses, "eval_loss": sum(ev) / len(ev), "seconds": elapsed, "params": n_params}


def main():
    ap = argparse.ArgumentParser(description="tiny Llama: sdpa vs fp8_delta loss curves")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-blocks", type=int, default=32)
    ap.add_argument("--attn", default="sdpa,fp8_delta")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("train_smoke needs a CUDA GPU (the fp8 backends run Triton kernels)")
    import hf_fp8_attention  # noqa: F401  (registers "fp8_delta" / "fp8_stale" with Transformers)

    data = stdlib_bytes(24 << 20)
    runs = [train_one(a, data, args, torch.device("cuda")) for a in args.attn.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = runs[0]["losses"]
    summary = {}
    for r in runs:
        n = min(len(base), len(r["losses"]))
        tail = slice(max(0, n - 20), n)
        summary[r["attn"]] = {
            "params": r["params"], "seconds": round(r["seconds"], 1), "eval_loss": round(r["eval_loss"], 4),
            "final_train_loss_avg20": round(sum(r["losses"][tail]) / max(1, n - tail.start), 4),
            "max_abs_gap_vs_first": round(max(abs(a - b) for a, b in zip(base[:n], r["losses"][:n])), 4),
            "mean_gap_last20_vs_first": round(sum(a - b for a, b in zip(r["losses"][tail], base[tail])) / max(1, n - tail.start), 4),
        }
    (out / "train_smoke.json").write_text(json.dumps({"args": vars(args), "summary": summary,
                                                       "curves": {r["attn"]: r["losses"] for r in runs}}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for r in runs:
            ax.plot(r["losses"], label=f"{r['attn']} (eval {r['eval_loss']:.3f})", lw=1)
        ax.set_xlabel("step"), ax.set_ylabel("train loss (bytes, nats)"), ax.set_yscale("log")
        ax.set_title(f"tiny Llama {runs[0]['params'] / 1e6:.1f}M, seq {args.seq_len}, head_dim {args.head_dim}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "train_smoke.png", dpi=110)
    except ImportError as err:
        print(f"no plot: {err}")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
