#!/usr/bin/env python
"""Write ``quickstart.ipynb`` and ``stale_delta.ipynb`` from the cell sources below and execute them.

    python notebooks/build_notebooks.py            # full mode: the stored, executed notebooks
    HF_FP8_NOTEBOOK_MODE=reduced python notebooks/build_notebooks.py --out /tmp/nb   # what the test runs

The notebooks read ``HF_FP8_NOTEBOOK_MODE`` (``full`` or ``reduced``) to size their experiments;
both modes run on a CPU (the PyTorch emulation of the FP8 recipe).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent

SETUP = '''\
import os, sys
from pathlib import Path
# Run from a source checkout without installing: make the repository importable.
root = Path.cwd() if (Path.cwd() / "hf_fp8_attention").is_dir() else Path.cwd().parent
sys.path.insert(0, str(root))
MODE = os.environ.get("HF_FP8_NOTEBOOK_MODE", "full")
assert MODE in ("full", "reduced"), f"HF_FP8_NOTEBOOK_MODE must be 'full' or 'reduced', got {MODE!r}"
%matplotlib inline
import warnings
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm.auto without ipywidgets
import matplotlib.pyplot as plt
from IPython.display import display
import torch
torch.manual_seed(0)
print("mode:", MODE)'''

QUICKSTART = [
    ("md", """\
# hf_fp8_attention — quickstart

Trainable block-scaled FP8 attention for Hugging Face Transformers with a **delta-matched** backward.
This notebook installs the package, registers the attention implementations, trains a small model
with `sdpa`, `fp8_stale` and `fp8_delta`, and compares them. It runs on a CPU (the PyTorch
emulation of the FP8 recipe) in a few minutes; on an FP8-capable GPU the same code uses the
Triton kernels.

**Install** (from the repository root):

```bash
pip install -e ".[train]"
```"""),
    ("code", SETUP),
    ("md", "## 1. What this machine supports\n\n`python -m hf_fp8_attention check` in a cell: versions, "
           "GPU and FP8 capability, which path runs (Triton kernels or emulation), a numerics self-test."),
    ("code", """\
from hf_fp8_attention.cli import main as cli
exit_code = cli(["check"])"""),
    ("md", """\
## 2. Register

`import hf_fp8_attention` registers `"fp8_delta"` (Delta-Matching) and `"fp8_stale"` (the usual
FlashAttention-style delta, the ablation baseline) with Transformers' `AttentionInterface`. A model
opts in with `attn_implementation=...` — for a checkpoint on disk:
`AutoModelForCausalLM.from_pretrained(path, attn_implementation="fp8_delta")`. Here we build a small
Llama from a config (head_dim 64, GQA)."""),
    ("code", """\
import hf_fp8_attention
from transformers import AttentionInterface, AutoModelForCausalLM
from hf_fp8_attention.training import load_corpus, train_tokenizer, group_texts, split_train_eval, tiny_config

print("registered:", [n for n in AttentionInterface._global_mapping if n.startswith("fp8")])
corpus = load_corpus(max_bytes=1_500_000 if MODE == "full" else 300_000)  # the stdlib's own sources
tokenizer = train_tokenizer(corpus, vocab_size=2048, show_progress=False)
SEQ = 64
config = tiny_config("llama", "tiny", vocab_size=len(tokenizer), max_position_embeddings=SEQ, tokenizer=tokenizer)
model = AutoModelForCausalLM.from_config(config, attn_implementation="fp8_delta")
print(model.config._attn_implementation, "|", sum(p.numel() for p in model.parameters()) / 1e6, "M params |",
      len(corpus), "documents")"""),
    ("md", "## 3. Train the same model three ways\n\nSame initial weights, same batches, same schedule; "
           "only the attention implementation differs."),
    ("code", """\
from hf_fp8_attention.training.loop import blocks_tensor, evaluate, train
from hf_fp8_attention.training.models import build_model
from hf_fp8_attention.training.residual import row_sum_residuals

STEPS = 60 if MODE == "full" else 8
blocks = group_texts(corpus, tokenizer, SEQ)
train_ds, eval_ds = split_train_eval(blocks, min_eval=16)
train_blocks, eval_blocks = blocks_tensor(train_ds), blocks_tensor(eval_ds)
runs = {}
for attn in ("sdpa", "fp8_stale", "fp8_delta"):
    m = build_model(config, attn, seed=0)
    log = train(m, train_blocks, steps=STEPS, batch_size=8, lr=2e-3, device="cpu", desc=attn, progress=False)
    log["eval_loss"] = evaluate(m, eval_blocks, batch_size=8, device="cpu")
    log["residual"] = None if attn == "sdpa" else row_sum_residuals(m, eval_blocks[:2], attn)["median"]
    runs[attn] = log
    print(f"{attn:<10} final loss {log['loss'][-1]:.3f}  eval {log['eval_loss']:.3f}")"""),
    ("md", """\
## 4. Compare

The row-sum residual replays each run's FP8 backward on the trained model's real attention inputs
and gradients (one held-out batch): the median over query rows of |Σ_j dS_ij| / Σ_j P_ij |dP_ij|.
The exact softmax gradient has 0; Delta-Matching stays at fp32 rounding; the stale delta does not.
(On a CPU the FP8 runs use the PyTorch emulation, so tokens/s says nothing about the kernels.)
At this size and length the losses agree closely — the stale delta's damage is reported to grow
with model scale and sequence length (see `stale_delta.ipynb`)."""),
    ("code", """\
print(f"{'attention':<10} {'train loss':>10} {'eval loss':>10} {'tokens/s':>10} {'row-sum residual':>17}")
for attn, r in runs.items():
    res = "exact" if r["residual"] is None else f"{r['residual']:.1e}"
    print(f"{attn:<10} {sum(r['loss'][-5:]) / 5:>10.4f} {r['eval_loss']:>10.4f} {r['tokens_per_s']:>10,.0f} {res:>17}")
fig, ax = plt.subplots(figsize=(7, 4))
for attn, r in runs.items():
    ax.plot(r["steps"], r["loss"], label=attn)
ax.set(xlabel="step", ylabel="training loss", title="same model, three attention implementations")
ax.legend(); ax.grid(alpha=0.3)
display(fig); plt.close(fig)"""),
    ("md", """\
## Next

* `python -m hf_fp8_attention demo` — this comparison at a GPU-sized setting, with a PNG and a table.
* `examples/finetune.py` (Trainer, LoRA, packed batches), `examples/continued_pretraining.py`
  (Accelerate, DDP/FSDP2, resume), `examples/context_extension.py` (RoPE scaling) — each takes
  `--model PATH` and `--data` for your own checkpoint and corpus."""),
]

STALE = [
    ("md", """\
# The stale delta, and how Delta-Matching removes it

FlashAttention-style backward, per head (τ = softmax scale):

* recompute S = τ Q Kᵀ and P = exp(S − LSE); dP = dO Vᵀ
* dS = P ∘ (dP − D), dQ = τ dS K, dK = τ dSᵀ Q, with one number per query row **D_i**.

Softmax ignores a constant added to a row of S, so the exact gradient satisfies **Σ_j dS_ij = 0**,
because D_i = Σ_j P_ij dP_ij = dO_i · O_i. FlashAttention computes D_i = rowsum(dO ∘ O). In FP8 the
forward's O comes from the forward's quantized P and V, while the backward's dP comes from a
differently quantized dO and V: rowsum(dO ∘ O) is now a *stale* value that matches nothing the
backward computes, and every row of dS keeps a residue r_i = Σ_j dS_ij. That residue moves dQ_i along
the row's attention-weighted key mean Σ_j P_ij K_j and dK by the same total — a bias, not noise.

**Delta-Matching**: D_i = Σ_j P_ij dP_ij from the backward's own P and dP (and its own softmax
normaliser), which makes Σ_j dS_ij = 0 to fp32 rounding.

The **hybrid** recipe (FP8 forward, bf16 backward) has the same disease, worse: its backward logits
are not the forward's FP8 logits, so the forward's LSE and O match nothing it computes.

Below, every number comes from `hf_fp8_attention.diagnostics.diagnose`, which runs the PyTorch
emulation of the recipe once and compares with float64 attention."""),
    ("code", SETUP + '''
from hf_fp8_attention import RECIPES
from hf_fp8_attention.diagnostics import diagnose

RECIPE_NAMES = ["fp8_delta", "fp8_stale", "hybrid_delta", "hybrid_stale"]
STYLE = {"fp8_delta": ("C0", "-"), "fp8_stale": ("C3", "-"), "hybrid_delta": ("C0", "--"), "hybrid_stale": ("C3", "--")}
HEADS, KV_HEADS, D = (8, 2, 64) if MODE == "full" else (4, 2, 64)
LENGTHS = [128, 256, 512, 1024, 2048] if MODE == "full" else [64, 128, 256]

def inputs(S, *, sharp=1.0, key_bias=0.0, seed=0):
    """q (1, H, S, D), k/v (1, Hkv, S, D), dout like q. `sharp` scales the logits (peakier attention);
    `key_bias` adds one shared vector to every key (an outlier channel pattern seen in trained models)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, S, D, generator=g) * sharp
    k = torch.randn(1, KV_HEADS, S, D, generator=g) + key_bias * torch.randn(D, generator=g)
    v = torch.randn(1, KV_HEADS, S, D, generator=g)
    dout = torch.randn(1, HEADS, S, D, generator=g)
    return q, k, v, dout'''),
    ("md", """\
## 1. Row-sum residuals

For each valid query row, |Σ_j dS_ij| / Σ_j P_ij |dP_ij| (0 for the exact gradient), causal
attention, two input regimes: plain Gaussian, and peakier attention with a shared key bias."""),
    ("code", '''\
S_HIST = LENGTHS[-2]
regimes = {"gaussian": dict(), "sharp + key bias": dict(sharp=2.0, key_bias=2.0)}
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
for ax, (regime, kw) in zip(axes, regimes.items()):
    q, k, v, dout = inputs(S_HIST, **kw)
    for name in RECIPE_NAMES:
        rep = diagnose(q, k, v, dout, config=RECIPES[name], causal=True)
        r = rep.row_sum_residual.clamp_min(1e-12).log10()
        color, ls = STYLE[name]
        ax.hist(r.numpy(), bins=60, histtype="step", color=color, linestyle=ls, label=f"{name} (median {rep.median_row_sum_residual:.0e})")
    ax.set(title=f"{regime}, S = {S_HIST}", xlabel="log10 row-sum residual")
    ax.legend(fontsize=8)
axes[0].set_ylabel("query rows")
fig.tight_layout(); display(fig); plt.close(fig)'''),
    ("md", """\
Matched deltas (blue) sit at fp32 rounding, about five orders of magnitude below the stale ones
(red), in FP8 and in the hybrid recipe alike.

## 2. Gradient error and bias against sequence length

* **relative error** ‖dQ − dQ_exact‖ / ‖dQ_exact‖ (and dK), against float64 attention;
* **key-shift residual** ‖Σ_j dK_j‖ / ‖Σ_j |dK_j|‖: the exact dK sums to zero over keys (the same
  invariance), so what remains is the push every key receives together — the bias. Independent
  rounding errors partly cancel in this sum; a common offset does not."""),
    ("code", '''\
rows = []
for regime, kw in regimes.items():
    for S in LENGTHS:
        q, k, v, dout = inputs(S, **kw)
        for name in RECIPE_NAMES:
            rep = diagnose(q, k, v, dout, config=RECIPES[name], causal=True)
            rows.append(dict(regime=regime, S=S, recipe=name, residual=rep.median_row_sum_residual,
                             key_shift=rep.key_shift_residual, **{f"err_{key}": val for key, val in rep.rel_err.items()}))

fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
for row_axes, regime in zip(axes, regimes):
    for name in RECIPE_NAMES:
        sel = [r for r in rows if r["regime"] == regime and r["recipe"] == name]
        color, ls = STYLE[name]
        for ax, key in zip(row_axes, ("err_dq", "err_dk", "key_shift")):
            ax.plot([r["S"] for r in sel], [r[key] for r in sel], color=color, linestyle=ls, marker="o", label=name)
    for ax, title in zip(row_axes, ("dQ relative error", "dK relative error", "key-shift residual (bias)")):
        ax.set(yscale="log", title=f"{title} — {regime}", xlabel="sequence length")
        ax.set_xscale("log", base=2)
        ax.set_xticks(LENGTHS, [str(n) for n in LENGTHS])
        ax.grid(alpha=0.3, which="both")
axes[0, 0].legend(fontsize=8)
fig.tight_layout(); display(fig); plt.close(fig)'''),
    ("md", "## 3. Stale vs matched, FP8 vs hybrid, at the longest length"),
    ("code", '''\
S = LENGTHS[-1]
print(f"S = {S}, causal, {HEADS} query heads / {KV_HEADS} kv heads, head_dim {D}")
for regime in regimes:
    print(f"\\n{regime}")
    print(f"{'recipe':<13} {'row-sum residual':>16} {'dQ err':>8} {'dK err':>8} {'dV err':>8} {'key shift':>10}")
    for r in (r for r in rows if r["regime"] == regime and r["S"] == S):
        print(f"{r['recipe']:<13} {r['residual']:>16.1e} {r['err_dq']:>8.4f} {r['err_dk']:>8.4f} {r['err_dv']:>8.4f} {r['key_shift']:>10.1e}")'''),
    ("md", """\
Reading the plots:

* **Matched vs stale.** With a matched delta the row sums vanish; what is left of the key shift is
  rounding noise of the FP8 (or bf16) products. With the stale delta the key shift sits several
  times above it at every length (for these random inputs both fall with length, because the stale
  row residue itself shrinks as attention spreads over more keys; in trained models attention is far
  peakier). That excess is not noise: it is the same push on every key, step after step.
* **FP8 vs hybrid.** The hybrid backward's operands are bf16, so its matched gradients are an order
  of magnitude more accurate than FP8's — but with the stale delta its gradient error is several
  times larger than its matched error: the bf16 backward buys nothing while D is stale. This is the
  configuration the design notes report to blow up in training (hybrid-stale) while hybrid-matched,
  FP8-matched and bf16 reach the same loss.
* In full FP8 the stale delta's extra norm-wise error is modest next to FP8 rounding itself (larger
  with peaky attention and a key bias); what matters is that it is systematic, and such errors accumulate over many steps and layers — the
  reported gap grows with model scale and in context extension, where this notebook cannot reach."""),
]


def build(cells) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
                for kind, src in cells]
    return nb


NOTEBOOKS = {"quickstart.ipynb": QUICKSTART, "stale_delta.ipynb": STALE}


def execute(path: Path, timeout: int = 1200) -> float:
    """Execute ``path`` in place (working directory: this folder); returns seconds taken."""
    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    nbformat.write(nb, path)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="where to write the notebooks")
    parser.add_argument("--no-execute", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, cells in NOTEBOOKS.items():
        path = args.out / name
        nbformat.write(build(cells), path)
        if not args.no_execute:
            print(f"{name}: executed in {execute(path):.0f}s (mode {os.environ.get('HF_FP8_NOTEBOOK_MODE', 'full')})")


if __name__ == "__main__":
    main()
