#!/usr/bin/env python
"""Continued pretraining with an Accelerate loop and FP8 attention: packed sequences, warmup +
cosine LR, checkpoint save/resume. Single process or ``accelerate launch`` (DDP, FSDP2).

    python examples/continued_pretraining.py --attn fp8_delta
    accelerate launch --config_file examples/accelerate/ddp.yaml   examples/continued_pretraining.py --attn fp8_delta
    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/continued_pretraining.py --attn fp8_delta
    python examples/continued_pretraining.py --resume latest      # continue from the last checkpoint
    ACCELERATE_USE_CPU=true torchrun --standalone --nproc_per_node 2 examples/continued_pretraining.py --tiny
                                                                  # DDP on CPU (gloo), as the tests run it

Data: documents joined with EOS and cut into fixed ``--seq-len`` blocks (every token trains, no
padding). Checkpoints: ``accelerator.save_state`` every ``--save-every`` steps under
``<output-dir>/checkpoints/step_N`` (model, optimizer, scheduler, RNG, data position); ``--resume``
takes such a directory or ``latest`` and continues the same data order, so a resumed run logs the
losses the uninterrupted run would have. The final model (+ tokenizer) goes to ``<output-dir>/final``.

``--model PATH`` / ``--data`` as in finetune.py. Defaults: GPU ~29M params, seq 1024, 8 sequences
per device, 300 steps, bf16; CPU/``--tiny`` 2 layers, seq 64, 30 steps.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout without install

import hf_fp8_attention  # noqa: E402,F401  (registers fp8_delta / fp8_stale with Transformers)
from hf_fp8_attention.training import (UsageError, build_model, group_texts, main_with_usage_errors,  # noqa: E402
                                       plot_loss_curves, split_train_eval)
from hf_fp8_attention.training.models import enable_checkpointing  # noqa: E402
from hf_fp8_attention.training.recipe import (add_common_args, loss_trend, output_dir, prepare,  # noqa: E402
                                              quiet_datasets, resolve_defaults, write_summary)

GPU_DEFAULTS = dict(size="small", seq_len=1024, batch_size=8, max_steps=300, lr=1e-3, vocab_size=8192,
                    corpus_bytes=None, warmup_steps=30, gradient_checkpointing=False, save_every=100)
TINY_DEFAULTS = dict(size="tiny", seq_len=64, batch_size=8, max_steps=30, lr=2e-3, vocab_size=2048,
                     corpus_bytes=1_500_000, warmup_steps=3, gradient_checkpointing=False, save_every=15)


def parse_args(argv=None) -> argparse.Namespace:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--save-every", type=int, help="checkpoint every N optimizer steps")
    parser.add_argument("--resume", help="checkpoint directory to resume from, or 'latest'")
    parser.add_argument("--eval-batches", type=int, default=4)
    return resolve_defaults(parser.parse_args(argv), gpu=GPU_DEFAULTS, tiny=TINY_DEFAULTS)


def _latest_checkpoint(ckpt_root: Path) -> Path:
    found = sorted(ckpt_root.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    if not found:
        raise UsageError(f"--resume latest: no checkpoint under {ckpt_root}")
    return found[-1]


@main_with_usage_errors
def main(argv=None) -> dict:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers import default_data_collator, get_cosine_schedule_with_warmup

    args = parse_args(argv)
    accelerator = Accelerator(mixed_precision="bf16" if args.bf16 else "no",
                              gradient_accumulation_steps=args.grad_accum,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(args.seed)
    quiet_datasets(args)
    out = output_dir(args, "continued_pretraining")
    ckpt_root = out / "checkpoints"
    resume_dir = None
    if args.resume:
        resume_dir = _latest_checkpoint(ckpt_root) if args.resume == "latest" else Path(args.resume)
        if not (resume_dir / "progress.json").exists():
            raise UsageError(f"--resume {args.resume}: {resume_dir} is not a checkpoint of this script "
                             "(no progress.json)")
    with accelerator.main_process_first():  # rank 0 trains/caches the tokenizer and maps the data first
        corpus, tokenizer, config = prepare(args)
        blocks = group_texts(corpus, tokenizer, args.seq_len)
    train_ds, eval_ds = split_train_eval(blocks, seed=args.seed,
                                         min_eval=args.eval_batches * args.batch_size)
    train_ds = train_ds.with_format("torch")
    eval_ds = eval_ds.with_format("torch")
    model = build_model(config, args.attn, model_path=args.model, seed=args.seed)
    if args.gradient_checkpointing:
        enable_checkpointing(model)

    def collate(rows):
        batch = default_data_collator(rows)
        batch["labels"] = batch["input_ids"].clone()
        return batch

    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=collate, drop_last=True)
    eval_dl = DataLoader(eval_ds, batch_size=args.batch_size, collate_fn=collate)
    if len(train_dl) == 0:
        raise UsageError(f"only {len(train_ds)} training blocks; need at least --batch-size {args.batch_size}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)
    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    # The schedule counts optimizer steps, so it is stepped by hand on sync steps only (a prepared
    # scheduler would advance num_processes times per step); registered so save_state keeps it.
    accelerator.register_for_checkpointing(scheduler)

    step, losses = 0, []
    if resume_dir is not None:
        accelerator.load_state(str(resume_dir))
        progress = json.loads((resume_dir / "progress.json").read_text())
        step, losses = progress["step"], progress["losses"]
        accelerator.print(f"resumed from {resume_dir} at step {step}")
    batches_per_epoch = len(train_dl) // args.grad_accum
    if batches_per_epoch == 0:
        raise UsageError("--grad-accum is larger than the number of batches per epoch")

    model.train()
    bar = tqdm(total=args.max_steps, initial=step, desc=f"pretrain {args.attn}",
               disable=args.no_progress or not accelerator.is_main_process, dynamic_ncols=True)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * accelerator.num_processes
    while step < args.max_steps:
        epoch, done_in_epoch = divmod(step, batches_per_epoch)
        train_dl.set_epoch(epoch)  # same order per epoch on every run: resume continues the exact stream
        loader = accelerator.skip_first_batches(train_dl, done_in_epoch * args.grad_accum) if done_in_epoch else train_dl
        running = 0.0
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            running += loss.detach().float() / args.grad_accum
            if not accelerator.sync_gradients:
                continue
            step_loss = float(accelerator.reduce(running, reduction="mean"))
            running = 0.0
            if not math.isfinite(step_loss):
                raise FloatingPointError(f"loss became {step_loss} at step {step + 1}")
            step += 1
            losses.append(step_loss)
            bar.update(1)
            bar.set_postfix(loss=f"{step_loss:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
            if args.no_progress and accelerator.is_main_process and (step % 10 == 0 or step == args.max_steps):
                print(f"step {step}/{args.max_steps} loss {step_loss:.4f}", flush=True)
            if step % args.save_every == 0 or step == args.max_steps:
                ckpt = ckpt_root / f"step_{step}"
                accelerator.save_state(str(ckpt))
                if accelerator.is_main_process:
                    (ckpt / "progress.json").write_text(json.dumps({"step": step, "losses": losses}))
                accelerator.wait_for_everyone()
            if step >= args.max_steps:
                break
    bar.close()

    model.eval()
    eval_total, eval_count = torch.zeros((), device=accelerator.device), torch.zeros((), device=accelerator.device)
    with torch.no_grad():
        for batch in eval_dl:
            n = torch.tensor(float(batch["input_ids"].numel()), device=accelerator.device)
            eval_total += model(**batch).loss.float() * n
            eval_count += n
    eval_loss = float(accelerator.reduce(eval_total, "sum") / accelerator.reduce(eval_count, "sum"))

    state_dict = accelerator.get_state_dict(model)  # gathers FSDP shards; every rank must call it
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(str(out / "final"), state_dict=state_dict, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    summary = {}
    if accelerator.is_main_process:
        tokenizer.save_pretrained(str(out / "final"))
        png = plot_loss_curves({args.attn: (list(range(1, len(losses) + 1)), losses)}, out / "loss_curve.png",
                               title=f"continued pretraining, {args.attn}, {accelerator.num_processes} process(es)",
                               smooth=max(1, len(losses) // 20))
        first, last = loss_trend(losses)
        mem = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        summary = {"example": "continued_pretraining", "attn": args.attn, "setting": args.setting,
                   "distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes,
                   "mixed_precision": accelerator.mixed_precision, "steps": step, "seq_len": args.seq_len,
                   "tokens_per_step": tokens_per_step, "loss_first_quarter": first, "loss_last_quarter": last,
                   "eval_loss": eval_loss, "resumed_from": str(resume_dir) if resume_dir else None,
                   "peak_memory_gib_rank0": mem, "losses": losses, "plot": str(png)}
        write_summary(out, summary, [
            f"continued pretraining | attn {args.attn} | {summary['distributed_type']} x {accelerator.num_processes} | "
            f"mixed precision {accelerator.mixed_precision}",
            f"{step} steps x {tokens_per_step} tokens | train loss {first:.3f} -> {last:.3f} | eval loss {eval_loss:.3f}"
            + (f" | peak mem rank0 {mem:.1f} GiB" if mem is not None else ""),
            f"loss curve: {png} | checkpoints: {ckpt_root}",
        ])
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
