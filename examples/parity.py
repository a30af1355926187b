#!/usr/bin/env python
"""Loss-parity study of the FP8 attention recipes against sdpa: one command per phase, resumable.

    python examples/parity.py finetune --model DIR --max-minutes 9   # 1. SmolLM2-135M, full + LoRA, seq 2048
    python examples/parity.py extend   --model DIR --max-minutes 9   # 2. YaRN context extension 2k -> 8k
    python examples/parity.py ladder   --max-minutes 9               # 3. from scratch: ~30M / ~120M / ~350M Llamas
    python examples/parity.py report                                 # tables + PNGs from the run folders

Every phase trains the same model on the same batches (same data order, same seed) once per
attention mode (``--modes``, default: sdpa and every FP8 recipe below) with the Transformers
Trainer. A run is identified by (phase, model/size, full|lora, mode, seed) and lives in
``<out-dir>/<phase>/<model>-<full|lora>/<mode>-seed<seed>/``: ``run.json`` (its settings and the
command), ``log.jsonl`` (train loss every logging step, held-out loss every ``--eval-every``
steps, probe metrics every ``--probe-every`` steps), Trainer checkpoints under ``trainer/`` and,
once finished, ``done.json``.

Resuming: ``--max-minutes M`` stops the whole command cleanly, with a checkpoint saved, before M
minutes have passed (``--stop-after N``: after N optimizer steps of each run, for tests).
Re-running the same command resumes each unfinished run from its last checkpoint (same data order;
log lines past that checkpoint are dropped, none before it is recomputed) and skips finished runs.
So on machines that allow 10-minute jobs, repeat ``... --max-minutes 9`` until it prints
``all runs finished``.

Probe (every ``--probe-every`` steps, on a fixed held-out batch, no optimizer step): per layer,
the zero-row-sum residual (median over query rows) and the key-shift residual of the run's FP8
recipe, replayed on the model's real q, k, v, dO (``hf_fp8_attention.training.residual``); and
the cosine between the model's full gradient under the run's attention and under sdpa at the same
weights (bf16 autocast on a GPU, fp32 on a CPU).

Models: ``--model DIR`` a local plain checkpoint folder (config.json, weights, tokenizer), or
``--gguf FILE|smollm2`` (converted once to a plain folder under ``<out-dir>/base``; needs
``hf_fp8_attention.training.pretrained``). The ladder builds Llamas from configs with a BPE
tokenizer trained on the corpus. ``--tiny`` (automatic without a CUDA GPU): 2-layer models, seq
64, a few steps, so each phase finishes in seconds on a CPU (a random tiny model stands in for
the pretrained one when no ``--model`` is given).
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout without install
sys.path.insert(0, str(Path(__file__).resolve().parent))  # context_extension.extended_config

import hf_fp8_attention  # noqa: E402  (registers fp8_delta / fp8_stale with Transformers)
from hf_fp8_attention.training import UsageError, main_with_usage_errors  # noqa: E402
from hf_fp8_attention.training.corpus import package_names, package_versions  # noqa: E402
from hf_fp8_attention.training.ladder_summary import ladder_gaps, ladder_table, plot_ladder_gaps  # noqa: E402

PHASES = ("finetune", "extend", "ladder")
MODES = ("sdpa", "fp8_delta", "fp8_stale", "fp8_delta_fast", "hybrid_delta", "hybrid_stale")
REFERENCE = "sdpa"
# Llama shapes of the ladder (head_dim 64, 4 kv heads, 5 at 60m whose 10 heads 4 does not divide, tied
# embeddings; params with an 8k vocab). 60m is the middle rung of the ladder that fits 30-minute GPU
# slots, whose runs cannot carry a checkpoint from one machine to the next (docs/parity.md): 30m,
# 60m, 120m; 350m needs longer.
LADDER = {
    "30m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64),
    "60m": dict(hidden_size=640, intermediate_size=1920, num_hidden_layers=12, num_attention_heads=10,
                num_key_value_heads=5, head_dim=64),
    "120m": dict(hidden_size=768, intermediate_size=2304, num_hidden_layers=16, num_attention_heads=12,
                 num_key_value_heads=4, head_dim=64),
    "350m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=30, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64),
}
TINY_LADDER = {  # the same rungs at CPU size (1-3 layers, head_dim 64 as the FP8 recipes need)
    "30m": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
                num_key_value_heads=1, head_dim=64),
    "60m": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=64),
    "120m": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64),
    "350m": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64),
}
# Per phase: gpu and tiny defaults (flags override).
DEFAULTS = {
    "finetune": {
        "gpu": dict(seq_len=2048, batch_size=4, grad_accum=1, max_steps=1000, lr=5e-5, lora_lr=4e-4,
                    warmup_steps=50, eval_every=100, probe_every=100, save_every=100, eval_blocks=64,
                    variants="full,lora", gradient_checkpointing=False),
        "tiny": dict(seq_len=64, batch_size=4, grad_accum=1, max_steps=8, lr=2e-3, lora_lr=8e-3, warmup_steps=2,
                     eval_every=4, probe_every=4, save_every=4, eval_blocks=8, variants="full",
                     gradient_checkpointing=False),
    },
    "extend": {
        # 250 steps x 4 x 8192 = 8.2M tokens, phase 1's count, so that the six modes, side by side on
        # one GPU, finish within one 30-minute machine slot (a run's checkpoint cannot leave the machine).
        "gpu": dict(base_len=2048, factor=4.0, batch_size=1, grad_accum=4, max_steps=250, lr=3e-5, lora_lr=3e-4,
                    warmup_steps=25, eval_every=50, probe_every=50, save_every=50, eval_blocks=16,
                    variants="full", gradient_checkpointing=False, probe_layers=8),
        "tiny": dict(base_len=32, factor=4.0, batch_size=2, grad_accum=1, max_steps=4, lr=1e-3, lora_lr=4e-3,
                     warmup_steps=1, eval_every=2, probe_every=2, save_every=2, eval_blocks=4, variants="full",
                     gradient_checkpointing=True, probe_layers=None),
    },
    "ladder": {
        "gpu": dict(seq_len=2048, batch_size=16, grad_accum=1, tokens_per_param=1.0, lr=1e-3, warmup_frac=0.05,
                    eval_every=200, probe_every=200, save_every=200, eval_blocks=64, vocab_size=8192,
                    variants="full", gradient_checkpointing=False),
        "tiny": dict(seq_len=64, batch_size=4, grad_accum=1, tokens_per_param=0.01, lr=2e-3, warmup_frac=0.1,
                     eval_every=4, probe_every=4, save_every=4, eval_blocks=8, vocab_size=2048,
                     variants="full", gradient_checkpointing=False, corpus_bytes=300_000),
    },
}
TINY_CORPUS_BYTES = 300_000


# ----------------------------------------------------------------------------------------------
# arguments


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("runs")
    g.add_argument("--out-dir", help="root of the run folders (default outputs/parity, outputs/parity-tiny)")
    g.add_argument("--tiny", action="store_true", help="CPU-sized models, lengths and steps (automatic without CUDA)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    for phase in PHASES:
        p = sub.add_parser(phase, parents=[common], help=f"phase: {phase}")
        p.add_argument("--modes", default=",".join(MODES),
                       help=f"comma list of attention modes: sdpa or any recipe name (default: {MODES})")
        p.add_argument("--variants", help="comma list of full,lora")
        p.add_argument("--seeds", help="comma list of model seeds (ladder default: 0,1 at the smallest size, 0 else)")
        p.add_argument("--data", help="text/JSON/CSV/Parquet file(s), a save_to_disk dataset, or packages:NAME,... "
                                      "(installed packages' Python sources, e.g. packages:torch,transformers); "
                                      "default: the Python standard library's sources")
        p.add_argument("--text-column", default="text")
        p.add_argument("--corpus-bytes", type=int, help="cap on the size of the default or packages: corpus")
        p.add_argument("--data-seed", type=int, default=0, help="held-out split and batch order (same for all runs)")
        p.add_argument("--batch-size", type=int)
        p.add_argument("--grad-accum", type=int)
        p.add_argument("--max-steps", type=int)
        p.add_argument("--lr", type=float)
        p.add_argument("--warmup-steps", type=int)
        p.add_argument("--eval-every", type=int)
        p.add_argument("--eval-blocks", type=int, help="held-out sequences")
        p.add_argument("--probe-every", type=int, help="probe metrics every N steps (0: never)")
        p.add_argument("--probe-batch", type=int, default=1, help="sequences in the probe batch")
        p.add_argument("--probe-layers", type=int, help="replay the residual on the first N layers only")
        p.add_argument("--save-every", type=int)
        p.add_argument("--lora-rank", type=int, default=16)
        p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None)
        p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None)
        p.add_argument("--max-minutes", type=float, help="stop (checkpoint saved) before this many minutes")
        p.add_argument("--stop-after", type=int, help="stop each run after N more optimizer steps (tests)")
        p.add_argument("--save-final", action="store_true", help="also save the final model (or adapter)")
        if phase in ("finetune", "extend"):
            p.add_argument("--model", help="local plain checkpoint folder of the pretrained model (SmolLM2-135M)")
            p.add_argument("--gguf", help="a GGUF file, or 'smollm2' for the packaged SmolLM2-135M GGUF")
        if phase in ("finetune", "ladder"):
            p.add_argument("--seq-len", type=int)
        if phase == "extend":
            p.add_argument("--base-len", type=int, help="the model's original context (default 2048)")
            p.add_argument("--factor", type=float, help="YaRN factor: trained length = base x factor")
            p.add_argument("--rope-type", choices=("yarn", "linear", "dynamic"), default="yarn")
            p.add_argument("--seq-len", type=int, help="default base x factor")
        if phase == "ladder":
            p.add_argument("--sizes", default=",".join(LADDER), help=f"comma list of {list(LADDER)}")
            p.add_argument("--tokens-per-param", type=float, help="training tokens per parameter (all sizes)")
            p.add_argument("--vocab-size", type=int)
    r = sub.add_parser("report", parents=[common], help="tables and PNGs from the run folders")
    r.add_argument("--report-dir", help="where report.md and the PNGs go (default <out-dir>/report)")
    r.add_argument("--smooth", type=int, default=20, help="moving average of the train-loss curves")
    args = parser.parse_args(argv)
    import torch

    args.setting = "tiny" if (args.tiny or not torch.cuda.is_available()) else "gpu"
    if args.out_dir is None:
        args.out_dir = "outputs/parity-tiny" if args.setting == "tiny" else "outputs/parity"
    if args.command == "report":
        return args
    defaults = DEFAULTS[args.command][args.setting]
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.setting == "tiny" and args.corpus_bytes is None:
        args.corpus_bytes = TINY_CORPUS_BYTES
    args.modes = _csv(args.modes)
    args.variants = _csv(args.variants)
    for mode in args.modes:
        if mode != REFERENCE and mode not in hf_fp8_attention.RECIPES:
            raise UsageError(f"--modes: {mode!r} is not {REFERENCE} or a recipe of hf_fp8_attention.RECIPES "
                             f"({', '.join(sorted(hf_fp8_attention.RECIPES))})")
    for variant in args.variants:
        if variant not in ("full", "lora"):
            raise UsageError(f"--variants: {variant!r} is not full or lora")
    if args.command == "ladder":
        args.sizes = _csv(args.sizes)
        for size in args.sizes:
            if size not in LADDER:
                raise UsageError(f"--sizes: {size!r} is not one of {', '.join(LADDER)}")
    for key in ("batch_size", "grad_accum", "max_steps", "eval_every", "eval_blocks", "save_every", "probe_batch",
                "stop_after", "seq_len", "base_len"):
        value = getattr(args, key, None)
        if value is not None and value < 1:
            raise UsageError(f"--{key.replace('_', '-')} must be a positive integer, got {value}")
    if args.probe_every is not None and args.probe_every < 0:
        raise UsageError(f"--probe-every must be >= 0, got {args.probe_every}")
    if args.max_minutes is not None and args.max_minutes < 0:
        raise UsageError(f"--max-minutes must be >= 0, got {args.max_minutes}")
    if args.bf16 is None:
        args.bf16 = args.setting == "gpu" and torch.cuda.is_bf16_supported()
    args.seeds = [int(s) for s in _csv(args.seeds)] if args.seeds else None
    return args


# ----------------------------------------------------------------------------------------------
# models and data


def register_modes(modes) -> None:
    """Register every FP8 recipe in ``modes`` with Transformers under its recipe name."""
    from transformers import AttentionInterface

    for mode in modes:
        if mode != "sdpa" and mode not in AttentionInterface._global_mapping:
            hf_fp8_attention.register_fp8_attention(mode, mode)


def load_gguf_checkpoint(gguf: str, out_root: Path) -> Path:
    """A plain checkpoint folder converted once from a GGUF file (the package's GGUF loader)."""
    try:
        from hf_fp8_attention.training.pretrained import convert_gguf, resolve_gguf_path
    except ImportError:
        raise UsageError("--gguf: this build of hf_fp8_attention has no GGUF loader "
                         "(hf_fp8_attention.training.pretrained); pass --model DIR, a plain checkpoint folder") from None
    path = resolve_gguf_path(gguf, flag="--gguf")
    return Path(convert_gguf(path, out_root / "base" / path.stem))


def tiny_base_checkpoint(args, out_root: Path, max_len: int) -> Path:
    """Tiny mode without --model: a random 2-layer Llama and a BPE tokenizer, saved once (seeded)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_fp8_attention.training import load_corpus, tiny_config, train_tokenizer

    path = out_root / "base" / f"tiny-llama-{max_len}"
    if (path / "config.json").exists():
        return path
    corpus = load_corpus(args.data, text_column=args.text_column, max_bytes=args.corpus_bytes)
    tokenizer = train_tokenizer(corpus, 2048, show_progress=False)
    config = tiny_config("llama", "tiny", vocab_size=len(tokenizer), max_position_embeddings=max_len,
                         tokenizer=tokenizer)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def base_checkpoint(args, out_root: Path, max_len: int) -> tuple[Path, str]:
    """``(folder, tag)`` of the pretrained model of the finetune/extend phases."""
    if args.model:
        from hf_fp8_attention.training import load_config

        load_config(args.model)  # one-line errors for a missing folder / config / family
        return Path(args.model), Path(args.model).name.lower()
    if args.gguf:
        path = load_gguf_checkpoint(args.gguf, out_root)
        return path, "smollm2-135m" if args.gguf == "smollm2" else path.name.lower()
    if args.setting == "tiny":
        return tiny_base_checkpoint(args, out_root, max_len), "tiny"
    raise UsageError(f"{args.command}: pass --model DIR (a local SmolLM2-135M checkpoint folder) or --gguf FILE|smollm2")


def blocks(corpus, tokenizer, seq_len: int, *, eval_blocks: int, data_seed: int):
    """Fixed-length blocks of the concatenated corpus, split into (train, held-out) datasets."""
    from hf_fp8_attention.training import group_texts, split_train_eval

    ds = group_texts(corpus, tokenizer, seq_len)
    return split_train_eval(ds, seed=data_seed, min_eval=min(eval_blocks, 2), max_eval=eval_blocks)


def collate(rows):
    import torch

    ids = torch.tensor([r["input_ids"] for r in rows], dtype=torch.long)
    return {"input_ids": ids, "labels": ids.clone()}


def apply_lora(model, rank: int):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


def count_params(config) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# the probe


def _base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def probe(model, ids, mode: str, *, bf16: bool, max_layers: int | None) -> dict:
    """Residuals of ``mode``'s recipe per layer, and the gradient cosine to sdpa, at the current weights."""
    import torch

    from hf_fp8_attention.training.residual import row_sum_residuals

    base = _base_model(model)
    device = next(model.parameters()).device
    ids = ids.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    was_training = model.training
    model.eval()

    def grads(attn):
        base.set_attn_implementation(attn)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        return float(loss.detach()), torch.autograd.grad(loss, params)

    out = {}
    try:
        if mode != REFERENCE:
            loss, g = grads(mode)
            ref_loss, g_ref = grads(REFERENCE)
            dot = sum(float((a.double() * b.double()).sum()) for a, b in zip(g, g_ref))
            n1 = math.sqrt(sum(float(a.double().square().sum()) for a in g))
            n2 = math.sqrt(sum(float(b.double().square().sum()) for b in g_ref))
            diff = math.sqrt(sum(float((a.double() - b.double()).square().sum()) for a, b in zip(g, g_ref)))
            out.update(grad_cos=dot / (n1 * n2) if n1 and n2 else float("nan"), grad_rel_err=diff / n2 if n2 else float("nan"),
                       probe_loss=loss, probe_loss_sdpa=ref_loss)
            del g, g_ref
    finally:
        base.set_attn_implementation(mode)
        model.train(was_training)
    if mode != REFERENCE:
        res = row_sum_residuals(base, ids, mode, max_layers=max_layers)
        out.update(row_sum_median=res["median"], row_sum_per_layer=res["per_layer_median"],
                   key_shift_per_layer=res["per_layer_key_shift"],
                   rel_err={k: float(v) for k, v in res["rel_err"].items()})
        base.set_attn_implementation(mode)
        model.train(was_training)
    return out


# ----------------------------------------------------------------------------------------------
# one run


class Deadline:
    """The wall-clock budget of the whole command (``--max-minutes``)."""

    def __init__(self, minutes):
        self.end = None if minutes is None else time.monotonic() + 60.0 * minutes

    def left(self) -> float:
        return math.inf if self.end is None else self.end - time.monotonic()


def _append(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _truncate_log(path: Path, step: int) -> None:
    """Drop log records of steps after ``step`` (logged before a crash, past the last checkpoint)."""
    records = read_log(path)
    kept = [r for r in records if r.get("step", 0) <= step or r.get("type") == "session"]
    if len(kept) != len(records):
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def make_callback(run_dir: Path, log_path: Path, mode: str, probe_ids, args, deadline: Deadline, on_gpu: bool):
    from transformers import TrainerCallback

    class ParityCallback(TrainerCallback):
        def __init__(self):
            self.start_step = 0
            self.stopped = False
            self.step_started = self.step_ended = None
            self.max_step_s = self.max_gap_s = 0.0
            self.save_s = 30.0 if on_gpu else 2.0  # a guess until the first save is timed
            self.save_measured = False

        def _probe(self, model, step):
            t0 = time.monotonic()
            rec = probe(model, probe_ids, mode, bf16=args.bf16, max_layers=args.probe_layers)
            _append(log_path, {"type": "probe", "step": step, "seconds": time.monotonic() - t0, **rec})

        def on_train_begin(self, targs, state, control, model=None, **kw):
            self.start_step = state.global_step
            _append(log_path, {"type": "session", "event": "start", "step": state.global_step, "time": time.time()})
            if state.global_step == 0 and args.probe_every:
                self._probe(model, 0)

        def on_step_begin(self, targs, state, control, **kw):
            now = time.monotonic()
            if self.step_ended is not None:
                self.max_gap_s = max(self.max_gap_s, now - self.step_ended)  # log, eval, save
            self.step_started = now

        def on_step_end(self, targs, state, control, model=None, **kw):
            step = state.global_step
            if self.step_started is not None:
                self.max_step_s = max(self.max_step_s, time.monotonic() - self.step_started)
            if args.probe_every and step % args.probe_every == 0:
                self._probe(model, step)
            self.step_ended = time.monotonic()
            if step >= state.max_steps:
                return control
            margin = 1.5 * (self.max_step_s + self.max_gap_s) + self.save_s
            if (args.stop_after and step - self.start_step >= args.stop_after) or deadline.left() < margin:
                control.should_training_stop = True
                control.should_save = True
                self.stopped = True
            return control

        def on_save(self, targs, state, control, **kw):
            if self.step_ended is not None:  # the first measured save replaces the guess
                took = time.monotonic() - self.step_ended
                self.save_s = max(self.save_s, took) if self.save_measured else took
                self.save_measured = True

        def on_log(self, targs, state, control, logs=None, **kw):
            logs = dict(logs or {})
            if "eval_loss" in logs:
                _append(log_path, {"type": "eval", "step": state.global_step, "eval_loss": logs["eval_loss"]})
            elif "loss" in logs:
                _append(log_path, {"type": "train", "step": state.global_step, "loss": logs["loss"],
                                   "lr": logs.get("learning_rate"), "grad_norm": logs.get("grad_norm")})

    return ParityCallback()


def train_run(spec: dict, *, make_model, train_ds, eval_ds, tokenizer, args, deadline: Deadline) -> str:
    """Train (or continue, or skip) one run; returns "done", "skipped" or "stopped"."""
    import torch
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    from hf_fp8_attention.training.recipe import checkpointing_args

    run_dir = Path(spec["run_dir"])
    name = f"{spec['phase']}/{spec['group']}/{spec['mode']}-seed{spec['seed']}"
    if (run_dir / "done.json").exists():
        done = json.loads((run_dir / "done.json").read_text())
        print(f"[{name}] already finished: held-out loss {done['final_eval_loss']:.4f} (skipped)", flush=True)
        return "skipped"
    run_dir.mkdir(parents=True, exist_ok=True)
    run_json = run_dir / "run.json"
    spec = {**spec, "recipe": recipe_fields(spec["mode"])}
    if run_json.exists():
        old = json.loads(run_json.read_text())
        if "recipe" in old and old["recipe"] != spec["recipe"]:
            raise UsageError(f"{run_dir} holds a run of {spec['mode']} under another recipe "
                             f"({old['recipe']}); pass another --out-dir")
        if old["settings"] != spec["settings"]:
            changed = sorted(k for k in set(old["settings"]) | set(spec["settings"])
                             if old["settings"].get(k) != spec["settings"].get(k))
            raise UsageError(f"{run_dir} holds a run with other settings ({', '.join(changed)}); "
                             "re-run with its settings or pass another --out-dir")
    else:
        run_json.write_text(json.dumps(spec, indent=1))
    trainer_dir = run_dir / "trainer"
    last = get_last_checkpoint(str(trainer_dir)) if trainer_dir.is_dir() else None
    log_path = run_dir / "log.jsonl"
    if last is None:
        log_path.unlink(missing_ok=True)
    else:
        step = json.loads((Path(last) / "trainer_state.json").read_text())["global_step"]
        _truncate_log(log_path, step)
    s = spec["settings"]
    on_gpu = torch.cuda.is_available() and args.setting == "gpu"
    print(f"[{name}] {'resuming from ' + Path(last).name if last else 'starting'} "
          f"({s['max_steps']} steps x {s['batch_size'] * s['grad_accum']} x {s['seq_len']} tokens)", flush=True)
    model = make_model()
    probe_ids = torch.tensor(eval_ds[:args.probe_batch]["input_ids"], dtype=torch.long)
    callback = make_callback(run_dir, log_path, spec["mode"], probe_ids, args, deadline, on_gpu)
    targs = TrainingArguments(
        output_dir=str(trainer_dir), max_steps=s["max_steps"], per_device_train_batch_size=s["batch_size"],
        per_device_eval_batch_size=s["batch_size"], gradient_accumulation_steps=s["grad_accum"],
        learning_rate=s["lr"], lr_scheduler_type="cosine", warmup_steps=s["warmup_steps"],
        weight_decay=0.0 if s["variant"] == "lora" else 0.1, max_grad_norm=1.0,
        logging_steps=1 if args.setting == "tiny" else 10, eval_strategy="steps", eval_steps=s["eval_every"],
        save_strategy="steps", save_steps=s["save_every"], save_total_limit=1, bf16=bool(args.bf16),
        **checkpointing_args(s["gradient_checkpointing"]), report_to=[], seed=spec["seed"],
        data_seed=s["data_seed"], disable_tqdm=args.no_progress, use_cpu=not on_gpu, dataloader_num_workers=0,
        prediction_loss_only=True,
        logging_nan_inf_filter=False)  # Trainer's default logs a NaN/inf step loss as the mean of the finite ones
    trainer = Trainer(model=model, args=targs, train_dataset=train_ds, eval_dataset=eval_ds, data_collator=collate,
                      callbacks=[callback])
    trainer.train(resume_from_checkpoint=last)
    if callback.stopped:
        print(f"[{name}] stopped at step {trainer.state.global_step}/{s['max_steps']} (checkpoint saved); "
              "re-run the same command to continue", flush=True)
        return "stopped"
    evals = [r for r in read_log(log_path) if r["type"] == "eval" and r["step"] == trainer.state.global_step]
    final = evals[-1]["eval_loss"] if evals else trainer.evaluate()["eval_loss"]
    _append(log_path, {"type": "final_eval", "step": trainer.state.global_step, "eval_loss": final})
    if args.save_final:
        trainer.save_model(str(run_dir / "final"))
    (run_dir / "done.json").write_text(json.dumps({"final_eval_loss": final, "steps": trainer.state.global_step,
                                                   "time": time.time()}, indent=1))
    print(f"[{name}] finished: held-out loss {final:.4f}", flush=True)
    return "done"


# ----------------------------------------------------------------------------------------------
# phases


def recipe_fields(mode: str) -> dict | None:
    """The FP8 recipe a mode names, field by field (None for sdpa), recorded in each run.json: a
    recipe's name outlives its settings (``fp8_delta`` took K and V per token in earlier versions)."""
    config = hf_fp8_attention.RECIPES.get(mode)
    if config is None:
        return None
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {k: v.value if isinstance(v, enum.Enum) else v for k, v in values.items()}


def _settings(args, **extra) -> dict:
    keys = ("batch_size", "grad_accum", "max_steps", "warmup_steps", "eval_every", "eval_blocks",
            "save_every", "gradient_checkpointing", "data_seed", "bf16", "probe_every", "probe_batch",
            "probe_layers", "data", "corpus_bytes", "setting")
    out = {k: getattr(args, k, None) for k in keys}
    packages = package_names(getattr(args, "data", None))
    if packages:  # the packages' versions identify the corpus's text (only then, so older runs resume)
        out["corpus_versions"] = package_versions(packages)
    out.update(extra)
    return out


_SELECTORS = ("--modes", "--variants", "--seeds", "--sizes", "--stop-after", "--max-minutes")


def _command(args, phase: str, **flags) -> str:
    """The command line that reproduces one run: this command's own flags (less the run selectors
    and the time limits), then the run's mode, variant, seed (and size)."""
    parts, argv, i = ["python", "examples/parity.py", phase], list(args._argv), 0
    while i < len(argv):
        flag = argv[i]
        name = flag.split("=", 1)[0]
        if name in _SELECTORS or name in ("--no-progress", "--tiny") or flag == phase:
            i += 1 if ("=" in flag or name in ("--no-progress", "--tiny") or flag == phase) else 2
            continue
        parts.append(flag)
        i += 1
    if args.setting == "tiny":
        parts.insert(3, "--tiny")
    for key, value in flags.items():
        if value is not None:
            parts += [f"--{key.replace('_', '-')}", str(value)]
    return shlex.join(parts)


def run_all(runs: list, args, deadline: Deadline) -> dict:
    """Train each ``(spec, make_model)`` in order until the deadline; report the state of all."""
    states = {}
    for spec, kwargs in runs:
        # A new process needs time to load a model, take a step and save: don't start a run without it.
        min_left = 60.0 if args.setting == "gpu" else 0.0
        if deadline.left() <= min_left and not (Path(spec["run_dir"]) / "done.json").exists():
            states[spec["run_dir"]] = "pending"
            continue
        states[spec["run_dir"]] = train_run(spec, args=args, deadline=deadline, **kwargs)
    pending = [k for k, v in states.items() if v in ("stopped", "pending")]
    print(f"\n=== {args.command} ===")
    print(f"{len(states) - len(pending)}/{len(states)} runs finished"
          + (f"; {len(pending)} unfinished: re-run the same command to continue" if pending else "; all runs finished"))
    return {"runs": states, "pending": pending}


def finetune_or_extend(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from hf_fp8_attention.training import load_corpus, load_config, load_tokenizer

    register_modes(args.modes)
    out_root = Path(args.out_dir)
    extend = args.command == "extend"
    if extend:
        from context_extension import extended_config

        seq_len = args.seq_len or int(args.base_len * args.factor)
        base_dir, tag = base_checkpoint(args, out_root, args.base_len)
    else:
        seq_len = args.seq_len
        base_dir, tag = base_checkpoint(args, out_root, seq_len)
    config = load_config(str(base_dir))
    tokenizer = load_tokenizer(str(base_dir))
    if extend:
        config = extended_config(config, base_len=args.base_len, factor=args.factor, rope_type=args.rope_type,
                                 seq_len=seq_len)
    elif seq_len > config.max_position_embeddings:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings "
                         f"({config.max_position_embeddings}); use the extend phase")
    corpus = load_corpus(args.data, text_column=args.text_column, max_bytes=args.corpus_bytes)
    train_ds, eval_ds = blocks(corpus, tokenizer, seq_len, eval_blocks=args.eval_blocks, data_seed=args.data_seed)
    seeds = args.seeds or [0]
    runs = []
    for variant in args.variants:
        lr = args.lr if variant == "full" else args.lora_lr
        for mode in args.modes:
            for seed in seeds:
                def make_model(mode=mode, variant=variant, seed=seed):
                    dtype = torch.bfloat16 if (args.bf16 and variant == "lora") else None
                    torch.manual_seed(seed)
                    model = AutoModelForCausalLM.from_pretrained(str(base_dir), config=config, attn_implementation=mode,
                                                                 local_files_only=True, dtype=dtype)
                    return apply_lora(model, args.lora_rank) if variant == "lora" else model

                group = f"{tag}-{variant}"
                settings = _settings(args, model=str(base_dir), seq_len=seq_len, lr=lr, variant=variant,
                                     lora_rank=args.lora_rank if variant == "lora" else None)
                if extend:
                    settings.update(base_len=args.base_len, factor=args.factor, rope_type=args.rope_type)
                flags = dict(modes=mode, variants=variant, seeds=seed)
                spec = {"phase": args.command, "group": group, "mode": mode, "seed": seed, "variant": variant,
                        "size": tag, "settings": settings, "command": _command(args, args.command, **flags),
                        "run_dir": str(out_root / args.command / group / f"{mode}-seed{seed}")}
                runs.append((spec, dict(make_model=make_model, train_ds=train_ds, eval_ds=eval_ds,
                                        tokenizer=tokenizer)))
    return run_all(runs, args, args._deadline)


def ladder(args) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_fp8_attention.training import load_corpus, train_tokenizer

    register_modes(args.modes)
    out_root = Path(args.out_dir)
    corpus = load_corpus(args.data, text_column=args.text_column, max_bytes=args.corpus_bytes)
    tokenizer = train_tokenizer(corpus, args.vocab_size, show_progress=not args.no_progress)
    train_ds, eval_ds = blocks(corpus, tokenizer, args.seq_len, eval_blocks=args.eval_blocks, data_seed=args.data_seed)
    shapes = TINY_LADDER if args.setting == "tiny" else LADDER
    smallest = next(iter(LADDER))
    runs = []
    for size in args.sizes:
        config = AutoConfig.for_model("llama", **shapes[size], vocab_size=len(tokenizer),
                                      max_position_embeddings=args.seq_len, tie_word_embeddings=True,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)
        params = count_params(config)
        tokens_per_step = args.batch_size * args.grad_accum * args.seq_len
        max_steps = args.max_steps or max(2, math.ceil(args.tokens_per_param * params / tokens_per_step))
        warmup = args.warmup_steps if args.warmup_steps is not None else max(1, int(args.warmup_frac * max_steps))
        seeds = args.seeds or ([0, 1] if size == smallest else [0])
        for mode in args.modes:
            for seed in seeds:
                def make_model(mode=mode, seed=seed, config=config):
                    torch.manual_seed(seed)
                    return AutoModelForCausalLM.from_config(config, attn_implementation=mode)

                group = f"{size}-full"
                settings = _settings(args, seq_len=args.seq_len, lr=args.lr, variant="full", size=size, params=params,
                                     vocab_size=args.vocab_size, tokens_per_param=args.tokens_per_param)
                settings.update(max_steps=max_steps, warmup_steps=warmup)
                flags = dict(sizes=size, modes=mode, seeds=seed)
                spec = {"phase": "ladder", "group": group, "mode": mode, "seed": seed, "variant": "full",
                        "size": size, "params": params, "settings": settings,
                        "command": _command(args, "ladder", **flags),
                        "run_dir": str(out_root / "ladder" / group / f"{mode}-seed{seed}")}
                runs.append((spec, dict(make_model=make_model, train_ds=train_ds, eval_ds=eval_ds,
                                        tokenizer=tokenizer)))
    return run_all(runs, args, args._deadline)


# ----------------------------------------------------------------------------------------------
# report


def _moving_average(values, n):
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > n:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def _plot(curves: dict, path: Path, *, title: str, ylabel: str, logy: bool = False, zero: bool = False) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, (xs, ys) in sorted(curves.items()):
        if xs:
            ax.plot(xs, ys, label=label, marker="o" if len(xs) < 30 else None, ms=3)
    if zero:
        ax.axhline(0.0, color="k", lw=0.8)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _progress(run: dict) -> str:
    """How far an unfinished run got: its last step and last held-out loss."""
    steps = [x["step"] for x in run["log"] if x["type"] == "train"]
    evals = [x for x in run["log"] if x["type"] == "eval"]
    text = f"stopped at step {max(steps) if steps else 0}/{run['spec']['settings']['max_steps']}"
    if evals:
        text += f", held-out {evals[-1]['eval_loss']:.4f} at step {evals[-1]['step']}"
    return text


def _spread(values: list[float]) -> str:
    if len(values) < 2:
        return "—"
    return f"±{(max(values) - min(values)) / 2:.4f} (n={len(values)})"


def report(args) -> dict:
    import statistics

    root = Path(args.out_dir)
    out = Path(args.report_dir or root / "report")
    runs = []
    for run_json in sorted(root.glob("*/*/*/run.json")):
        spec = json.loads(run_json.read_text())
        run_dir = run_json.parent
        log = read_log(run_dir / "log.jsonl")
        done = json.loads((run_dir / "done.json").read_text()) if (run_dir / "done.json").exists() else None
        runs.append({"spec": spec, "log": log, "done": done, "dir": run_dir})
    if not runs:
        raise UsageError(f"report: no run folders under {root} (run a phase first, or pass --out-dir)")
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["spec"]["phase"], r["spec"]["group"]), []).append(r)
    lines = ["# Parity results", "", f"Run folders: `{root}`. Final held-out loss = mean token loss on the held-out "
             "split after the last step; spread = half the range over seeds (n seeds); Δ = mode mean − sdpa mean.", ""]
    pngs = []
    for (phase, group), members in sorted(groups.items()):
        by_mode: dict = {}
        for r in members:
            by_mode.setdefault(r["spec"]["mode"], []).append(r)
        ref = [r["done"]["final_eval_loss"] for r in by_mode.get(REFERENCE, []) if r["done"]]
        ref_mean = statistics.mean(ref) if ref else None
        s0 = members[0]["spec"]["settings"]
        lines += [f"## {phase} — {group}", "",
                  f"seq {s0['seq_len']}, {s0['max_steps']} steps x {s0['batch_size'] * s0['grad_accum']} sequences, "
                  f"lr {s0['lr']}" + (f", {members[0]['spec'].get('params', 0) / 1e6:.1f}M params"
                                      if members[0]["spec"].get("params") else ""), "",
                  "| mode | seeds | final held-out loss | seed spread | Δ vs sdpa | last probe grad cos | "
                  "last probe row-sum residual (median) | status |",
                  "|---|---|---|---|---|---|---|---|"]
        for mode in [m for m in MODES if m in by_mode] + sorted(set(by_mode) - set(MODES)):
            rs = by_mode[mode]
            finals = [r["done"]["final_eval_loss"] for r in rs if r["done"]]
            mean = statistics.mean(finals) if finals else None
            probes = [p for r in rs for p in r["log"] if p["type"] == "probe"]
            last = probes[-1] if probes else {}
            status = "done" if len(finals) == len(rs) else f"{len(finals)}/{len(rs)} done"
            status += "".join(f"; s{r['spec']['seed']} {_progress(r)}" for r in rs if not r["done"])
            if any(not math.isfinite(v) for v in finals):
                status += "; held-out loss not finite (diverged)"
            # A missing value prints as —; NaN and inf print as themselves, never hidden.
            fmt = (lambda v, f: "—" if v is None else format(v, f))
            lines.append(f"| {mode} | {','.join(str(r['spec']['seed']) for r in rs)} | {fmt(mean, '.4f')} | "
                         f"{_spread(finals)} | {fmt(mean - ref_mean if mean is not None and ref_mean is not None and mode != REFERENCE else None, '+.4f')} | "
                         f"{fmt(last.get('grad_cos'), '.5f')} | {fmt(last.get('row_sum_median'), '.2e')} | {status} |")
        # Loss difference to sdpa (same seed, same steps), train (smoothed) and held-out.
        tag = f"{phase}_{group}"
        diff_train, diff_eval, row_sum, key_shift, cos, grad_norm = {}, {}, {}, {}, {}, {}
        refs = {r["spec"]["seed"]: r for r in by_mode.get(REFERENCE, [])}
        for mode, rs in by_mode.items():
            for r in rs:
                label = f"{mode} s{r['spec']['seed']}"
                # A diverging run's norm reaches inf or NaN: a gap in its curve, counted in its label.
                norms = [(x["step"], x["grad_norm"]) for x in r["log"] if x["type"] == "train" and x.get("grad_norm") is not None]
                bad = sum(not math.isfinite(v) for _, v in norms)
                if norms:
                    grad_norm[label + (f" ({bad} non-finite)" if bad else "")] = (
                        [s for s, _ in norms], [v if math.isfinite(v) else float("nan") for _, v in norms])
                probes = [p for p in r["log"] if p["type"] == "probe" and "row_sum_per_layer" in p]
                if probes:
                    row_sum[label] = ([p["step"] for p in probes], [p["row_sum_median"] for p in probes])
                    key_shift[label] = ([p["step"] for p in probes],
                                        [statistics.median(p["key_shift_per_layer"]) for p in probes])
                    cos[label] = ([p["step"] for p in probes], [1.0 - p["grad_cos"] for p in probes])
                ref_run = refs.get(r["spec"]["seed"])
                if mode == REFERENCE or ref_run is None:
                    continue
                for kind, store, smooth in (("train", diff_train, args.smooth), ("eval", diff_eval, 1)):
                    key = "loss" if kind == "train" else "eval_loss"
                    a = [(x["step"], x[key]) for x in r["log"] if x["type"] == kind]
                    b = dict((x["step"], x[key]) for x in ref_run["log"] if x["type"] == kind)
                    a = [(s, v) for s, v in a if s in b]
                    if not a:
                        continue
                    sa = _moving_average([v for _, v in a], smooth)
                    sb = _moving_average([b[s] for s, _ in a], smooth)
                    store[label] = ([s for s, _ in a], [x - y for x, y in zip(sa, sb)])
        figs = [("loss_diff_train", diff_train, f"train loss − sdpa (moving avg {args.smooth}), {phase} {group}",
                 "Δ train loss", False, True),
                ("loss_diff_eval", diff_eval, f"held-out loss − sdpa, {phase} {group}", "Δ held-out loss", False, True),
                ("row_sum_residual", row_sum, f"zero-row-sum residual (median over rows, layers), {phase} {group}",
                 "|Σ dS| / Σ P|dP|", True, False),
                ("key_shift_residual", key_shift, f"key-shift residual (median over layers), {phase} {group}",
                 "‖Σ dK‖ / ‖Σ |dK|‖", True, False),
                ("grad_cos", cos, f"1 − cos(gradient, sdpa gradient), {phase} {group}", "1 − cosine", True, False),
                ("grad_norm", grad_norm, f"gradient norm before clipping, {phase} {group}", "‖g‖", True, False)]
        lines.append("")
        for name, curves, title, ylabel, logy, zero in figs:
            if logy:
                curves = {k: (xs, [max(y, 1e-12) for y in ys]) for k, (xs, ys) in curves.items()}
            if any(xs for xs, _ in curves.values()):
                png = _plot(curves, out / f"{tag}_{name}.png", title=title, ylabel=ylabel, logy=logy, zero=zero)
                pngs.append(png)
                lines.append(f"![{name}]({png.name})")
        lines += ["", "Commands:", "", "```"]
        lines += sorted({r["spec"]["command"] for r in members})
        lines += ["```", ""]
    ladder_runs = [r for r in runs if r["spec"]["phase"] == "ladder"]
    if ladder_runs:  # the rungs side by side: each mode's gap to sdpa against the model size
        rows = ladder_gaps(ladder_runs, MODES, REFERENCE)
        lines += ["## ladder — across sizes", "",
                  "Final held-out loss minus sdpa's on the same seed (same initial weights and batches), the "
                  "mean over the seeds both finished; sdpa's own seed spread beside it.", "",
                  *ladder_table(rows, MODES, REFERENCE), ""]
        png = plot_ladder_gaps(rows, out / "ladder_gap_vs_params.png", reference=REFERENCE)
        pngs.append(png)
        lines += [f"![ladder_gap_vs_params]({png.name})", ""]
    out.mkdir(parents=True, exist_ok=True)
    md = out / "report.md"
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\n=== report ===\n{md}\n" + "\n".join(str(p) for p in pngs))
    return {"report": str(md), "pngs": [str(p) for p in pngs]}


@main_with_usage_errors
def main(argv=None) -> dict:
    args = parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.command == "report":
        return report(args)
    args._deadline = Deadline(args.max_minutes)
    if args.no_progress:
        import datasets

        datasets.disable_progress_bars()
    if args.command == "ladder":
        return ladder(args)
    return finetune_or_extend(args)


if __name__ == "__main__":
    main()
