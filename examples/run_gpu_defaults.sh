#!/usr/bin/env bash
# Run every example at its default GPU setting, plus the CLI check and demo, writing everything
# under $1 (default outputs/gpu_defaults). One log per run; the summaries are collected at the end
# into $OUT/SUMMARY.md. A failing run is recorded and the rest still run.
#
#   bash examples/run_gpu_defaults.sh /tmp/gpu_out            # 1 GPU: check, demo, examples
#   NGPU=2 bash examples/run_gpu_defaults.sh /tmp/gpu_out     # also DDP and FSDP2 via accelerate launch
#   PARTS="check demo" bash examples/run_gpu_defaults.sh /tmp/gpu_out   # a subset (to fit time limits)
# PARTS (default: all): check demo finetune pretrain distributed context probe
set -uo pipefail
PARTS="${PARTS:-check demo finetune pretrain distributed context probe}"
want() { case " $PARTS " in *" $1 "*) return 0;; *) return 1;; esac; }
cd "$(dirname "$0")/.."
OUT="${1:-outputs/gpu_defaults}"
mkdir -p "$OUT"
NGPU="${NGPU:-$(python -c 'import torch; print(torch.cuda.device_count())')}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
: >> "$OUT/SUMMARY.md"

step() {  # step NAME CMD...: run, log, append the summary block (or the error) to SUMMARY.md
  local name="$1"; shift
  echo "=== $name: $*" | tee -a "$OUT/SUMMARY.md"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  { if [ $rc -ne 0 ]; then echo "FAILED (exit $rc):"; tail -n 15 "$OUT/$name.log"
    elif grep -q '=== summary ===' "$OUT/$name.log"; then sed -n '/=== summary ===/,$p' "$OUT/$name.log" | tail -n +2
    else cat "$OUT/$name.log"; fi
    echo "[$name: exit $rc, $((SECONDS - t0)) s]"; echo; } | tee -a "$OUT/SUMMARY.md"
}

want check && step check python -m hf_fp8_attention check
want demo && step demo python -m hf_fp8_attention demo --no-progress --out-dir "$OUT/demo"

if want finetune; then
  for attn in fp8_delta fp8_stale sdpa; do
    step "finetune_$attn" python examples/finetune.py --attn "$attn" --no-progress --output-dir "$OUT/finetune/$attn"
  done
  step finetune_lora_packed_fp8_delta python examples/finetune.py --attn fp8_delta --lora --packed \
    --gradient-checkpointing --no-progress --output-dir "$OUT/finetune/lora_packed_fp8_delta"
fi
want pretrain && step continued_pretraining_fp8_delta python examples/continued_pretraining.py --attn fp8_delta \
  --no-progress --output-dir "$OUT/continued_pretraining/fp8_delta"
if want distributed && [ "$NGPU" -lt 2 ]; then
  echo "distributed: skipped, needs 2 GPUs (found $NGPU)" | tee -a "$OUT/SUMMARY.md"
fi
if want distributed && [ "$NGPU" -ge 2 ]; then
  for cfg in ddp fsdp2; do
    step "continued_pretraining_${cfg}_fp8_delta" accelerate launch --config_file "examples/accelerate/$cfg.yaml" \
      examples/continued_pretraining.py --attn fp8_delta --no-progress --max-steps 100 --save-every 50 \
      --output-dir "$OUT/continued_pretraining/${cfg}_fp8_delta"
    # Resume the same run from its step-50 checkpoint in a fresh directory; the losses must agree.
    step "continued_pretraining_${cfg}_resume" accelerate launch --config_file "examples/accelerate/$cfg.yaml" \
      examples/continued_pretraining.py --attn fp8_delta --no-progress --max-steps 100 --save-every 50 \
      --resume "$OUT/continued_pretraining/${cfg}_fp8_delta/checkpoints/step_50" \
      --output-dir "$OUT/continued_pretraining/${cfg}_resume"
    python - "$OUT/continued_pretraining/${cfg}_fp8_delta" "$OUT/continued_pretraining/${cfg}_resume" <<'PY' | tee -a "$OUT/SUMMARY.md"
import json, sys
a, b = (json.load(open(f"{d}/summary.json"))["losses"] for d in sys.argv[1:])
diff = max(abs(x - y) for x, y in zip(a[50:], b[50:]))
print(f"resume check: steps 51-100 max |loss difference| uninterrupted vs resumed = {diff:.2e}")
PY
  done
fi
if want context; then
  for attn in fp8_delta fp8_stale sdpa; do
    step "context_extension_$attn" python examples/context_extension.py --attn "$attn" --no-progress \
      --output-dir "$OUT/context_extension/$attn"
  done
fi
want probe && step context_extension_probe python examples/context_extension.py --attn fp8_delta --no-progress \
  --base-steps 1 --max-steps 1 --probe-max-len --output-dir "$OUT/context_extension/probe"
echo "all summaries: $OUT/SUMMARY.md"
