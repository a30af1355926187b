#!/usr/bin/env python
"""Extend a model's context with RoPE scaling and train it at the longer length with FP8 attention.

    python examples/context_extension.py --attn fp8_delta                         # defaults below
    python examples/context_extension.py --model /path/to/llama --base-len 4096 --factor 4 --rope-type yarn
    python examples/context_extension.py --probe-max-len                          # GPU: longest trainable length

Context extension is where the stale delta hurts most (longer rows: more terms in Σ_j dS_ij, and
the seed reports that even lower-LR extension only delays the damage), so this recipe also measures
the zero-row-sum residual of the fp8_stale and fp8_delta backwards on the trained model at the base
and the extended length.

Stages: (1) without ``--model``, a small model is first trained at ``--base-len`` (the "pretrained"
short-context model); with ``--model``, its ``max_position_embeddings`` is the base length unless
``--base-len`` says otherwise. (2) the config gets ``rope_parameters`` of ``--rope-type``
(yarn | linear | dynamic) with ``--factor``, and the model is trained on ``--seq-len`` (default
base x factor) packed blocks with gradient checkpointing. The held-out loss at the long length is
reported before and after. ``--probe-max-len`` (CUDA): for fp8_delta and sdpa, one training step
(batch 1, gradient checkpointing, bf16 autocast) at doubling lengths until out of memory; reports the
longest length that trains and its peak memory.

Defaults: GPU ~29M params, base 1024 -> 4096, 200 + 150 steps; CPU/``--tiny``: base 32 -> 128.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout without install

import hf_fp8_attention  # noqa: E402,F401  (registers fp8_delta / fp8_stale with Transformers)
from hf_fp8_attention.training import (UsageError, build_model, check_attn, group_texts,  # noqa: E402
                                       main_with_usage_errors, plot_loss_curves, split_train_eval)
from hf_fp8_attention.training.models import enable_checkpointing  # noqa: E402
from hf_fp8_attention.training.recipe import (add_common_args, output_dir, prepare, quiet_datasets,  # noqa: E402
                                              resolve_defaults, write_summary)

GPU_DEFAULTS = dict(size="small", base_len=1024, base_steps=200, max_steps=150, batch_size=4, lr=5e-4,
                    vocab_size=8192, corpus_bytes=None, gradient_checkpointing=True)
TINY_DEFAULTS = dict(size="tiny", base_len=32, base_steps=20, max_steps=12, batch_size=4, lr=2e-3,
                     vocab_size=2048, corpus_bytes=1_500_000, gradient_checkpointing=True)
ROPE_TYPES = ("yarn", "linear", "dynamic")


def parse_args(argv=None) -> argparse.Namespace:
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--base-len", type=int, help="the model's original context length")
    parser.add_argument("--factor", type=float, default=4.0, help="RoPE scaling factor (extended/base)")
    parser.add_argument("--rope-type", choices=ROPE_TYPES, default="yarn")
    parser.add_argument("--base-steps", type=int, help="stage-1 steps at base length (built models only)")
    parser.add_argument("--probe-max-len", action="store_true", help="CUDA: longest length one GPU trains")
    parser.add_argument("--probe-limit", type=int, default=262144, help="stop probing at this length")
    args = parser.parse_args(argv)
    base_len_given = args.base_len is not None
    args = resolve_defaults(args, gpu=GPU_DEFAULTS, tiny=TINY_DEFAULTS)
    if args.model is not None and not base_len_given:
        args.base_len = None  # a checkpoint's own max_position_embeddings is its base length
    if args.factor < 1.0:
        raise UsageError(f"--factor {args.factor}: must be >= 1 (this recipe extends, never shrinks, the context)")
    return args


def extended_config(config, *, base_len: int, factor: float, rope_type: str, seq_len: int):
    """A copy of ``config`` with RoPE scaling for ``base_len * factor`` positions."""
    if seq_len > int(base_len * factor):
        raise UsageError(f"--seq-len {seq_len} exceeds base length x factor = {int(base_len * factor)}; "
                         "raise --factor or shorten --seq-len")
    cfg = copy.deepcopy(config)
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rope.pop("original_max_position_embeddings", None)
    rope.update(rope_type=rope_type, factor=float(factor))
    if rope_type == "yarn":
        rope["original_max_position_embeddings"] = base_len
    cfg.rope_parameters = rope
    cfg.max_position_embeddings = max(seq_len, int(base_len * factor))
    return cfg


def _load(path, config, attn, gradient_checkpointing: bool):
    from transformers import AutoModelForCausalLM

    check_attn(attn)
    model = AutoModelForCausalLM.from_pretrained(str(path), config=config, attn_implementation=attn,
                                                 local_files_only=True)
    if gradient_checkpointing:
        enable_checkpointing(model)
    return model


def probe_max_len(config, *, start: int, limit: int) -> dict:
    """For fp8_delta and sdpa: one train step at doubling lengths (batch 1) until CUDA OOM."""
    import torch
    from transformers import AutoModelForCausalLM

    results = {}
    for attn in ("fp8_delta", "sdpa"):
        cfg = copy.deepcopy(config)
        cfg.max_position_embeddings = limit
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).cuda()
        enable_checkpointing(model)
        best, length, failed, points = None, start, None, []
        while length <= limit:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                ids = torch.randint(cfg.vocab_size, (1, length), device="cuda")
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                torch.cuda.synchronize()
                best = {"seq_len": length, "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
                points.append(best)
                print(f"probe {attn}: {length} tokens OK, peak {best['peak_memory_gib']:.1f} GiB", flush=True)
            except torch.cuda.OutOfMemoryError:
                failed = length
                print(f"probe {attn}: {length} tokens out of memory", flush=True)
                break
            finally:
                model.zero_grad(set_to_none=True)
                loss = ids = None
            length *= 2
        results[attn] = {"longest": best, "first_oom": failed, "limit": limit, "points": points}
        del model
        torch.cuda.empty_cache()
    return results


@main_with_usage_errors
def main(argv=None) -> dict:
    import torch

    from hf_fp8_attention.training.loop import blocks_tensor, evaluate, train
    from hf_fp8_attention.training.residual import row_sum_residuals

    args = parse_args(argv)
    quiet_datasets(args)
    if args.probe_max_len and not torch.cuda.is_available():
        raise UsageError("--probe-max-len needs a CUDA GPU")
    out = output_dir(args, "context_extension")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = torch.bfloat16 if args.bf16 else None
    progress = not args.no_progress

    user_seq = args.seq_len
    args.seq_len = args.base_len  # prepare() checks the base length against the base model
    corpus, tokenizer, config = prepare(args, check_len=args.base_len is not None)
    base_len = args.base_len or config.max_position_embeddings
    seq_len = user_seq or int(base_len * args.factor)
    args.seq_len = seq_len
    curves, summary = {}, {"example": "context_extension", "attn": args.attn, "setting": args.setting,
                           "rope_type": args.rope_type, "factor": args.factor, "base_len": base_len, "seq_len": seq_len}

    base_dir = out / "base"
    if args.model is None:  # stage 1: a short-context model to extend
        base_blocks = group_texts(corpus, tokenizer, base_len)
        b_train, _ = split_train_eval(base_blocks, seed=args.seed)
        model = build_model(config, args.attn, seed=args.seed)
        log = train(model, blocks_tensor(b_train), steps=args.base_steps, batch_size=args.batch_size * 4,
                    lr=args.lr, device=device, autocast_dtype=autocast, seed=args.seed,
                    desc=f"stage 1 @ {base_len}", progress=progress)
        curves[f"stage 1 (seq {base_len})"] = (log["steps"], log["loss"])
        model.save_pretrained(str(base_dir))
        tokenizer.save_pretrained(str(base_dir))
        del model
    else:
        base_dir = Path(args.model)

    ext_cfg = extended_config(config, base_len=base_len, factor=args.factor, rope_type=args.rope_type, seq_len=seq_len)
    long_blocks = group_texts(corpus, tokenizer, seq_len)
    l_train, l_eval = split_train_eval(long_blocks, seed=args.seed, min_eval=2 * args.batch_size)
    l_train, l_eval = blocks_tensor(l_train), blocks_tensor(l_eval)
    model = _load(base_dir, ext_cfg, args.attn, args.gradient_checkpointing).to(device)
    before = evaluate(model, l_eval, batch_size=args.batch_size, device=device, autocast_dtype=autocast)
    log = train(model, l_train, steps=args.max_steps, batch_size=args.batch_size, lr=args.lr / 2, device=device,
                autocast_dtype=autocast, seed=args.seed + 1, desc=f"stage 2 @ {seq_len}", progress=progress)
    after = evaluate(model, l_eval, batch_size=args.batch_size, device=device, autocast_dtype=autocast)
    offset = len(curves.get(f"stage 1 (seq {base_len})", ([],))[0])
    curves[f"stage 2 (seq {seq_len}, {args.rope_type} x{args.factor:g})"] = ([s + offset for s in log["steps"]], log["loss"])
    png = plot_loss_curves(curves, out / "loss_curve.png", title=f"context extension {base_len} -> {seq_len}, {args.attn}")
    model.save_pretrained(str(out / "final"))
    tokenizer.save_pretrained(str(out / "final"))

    # Residual of each FP8 backward on this model's real attention at the base and extended length.
    max_layers = None if args.setting == "tiny" else 2
    residual = {}
    for length in (base_len, seq_len):
        probe = l_eval[:1, :length].to(device)
        for recipe in ("fp8_stale", "fp8_delta"):
            residual[f"{recipe}@{length}"] = row_sum_residuals(model, probe, recipe, max_layers=max_layers)["median"]
    summary.update(eval_loss_before=before, eval_loss_after=after, tokens_per_s=log["tokens_per_s"],
                   gradient_checkpointing=bool(args.gradient_checkpointing), row_sum_residual_median=residual,
                   stage2_losses=log["loss"], plot=str(png),
                   peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None)
    lines = [
        f"context extension | attn {args.attn} | {args.rope_type} x{args.factor:g}: {base_len} -> {seq_len} tokens"
        f" | gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}",
        f"held-out loss at {seq_len}: {before:.3f} before -> {after:.3f} after {args.max_steps} steps"
        f" | {log['tokens_per_s']:,.0f} tokens/s",
        "row-sum residual (median): " + ", ".join(f"{k} {v:.1e}" for k, v in residual.items()),
        f"loss curve: {png}",
    ]
    if args.probe_max_len:
        del model
        torch.cuda.empty_cache()
        probe = probe_max_len(ext_cfg, start=seq_len, limit=args.probe_limit)
        summary["probe"] = probe
        probe_png = plot_loss_curves(
            {attn: ([p["seq_len"] for p in r["points"]], [p["peak_memory_gib"] for p in r["points"]])
             for attn, r in probe.items()},
            out / "probe_memory.png", title="one training step, batch 1, gradient checkpointing",
            xlabel="sequence length (tokens)", ylabel="peak GPU memory (GiB)")
        lines.append(f"memory vs length: {probe_png}")
        for attn, r in probe.items():
            best = r["longest"]
            lines.append(f"longest trainable on one GPU, {attn}: "
                         + (f"{best['seq_len']} tokens ({best['peak_memory_gib']:.1f} GiB peak)" if best else "none")
                         + (f"; OOM at {r['first_oom']}" if r["first_oom"] else f"; probe limit {r['limit']} reached"))
    write_summary(out, summary, lines)
    return summary


if __name__ == "__main__":
    main()
