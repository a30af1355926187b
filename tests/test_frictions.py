"""What a new user met in the CLI, the demo and the examples, each fixed and kept fixed.

Fast checks (no training beyond a couple of steps of a 1-layer model): the demo's tokens/s is the
median step (robust on a busy machine) and the table says so; no Transformers FutureWarning from
the package's own use of renamed arguments; complete one-line errors; ``--help`` texts; no empty
output folder after a failed run; no "Downloading data" for local files; ``--bf16`` on a CPU.
"""
from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import pytest
import torch

from hf_fp8_attention import cli
from hf_fp8_attention.training import errors, loop
from hf_fp8_attention.training.demo import format_table
from hf_fp8_attention.training.errors import UsageError, main_with_usage_errors
from hf_fp8_attention.training.recipe import checkpointing_args, output_dir, resolve_defaults


def _tiny_lm():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                         num_key_value_heads=1, head_dim=64, vocab_size=64, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def test_tokens_per_s_is_the_median_step_after_warmup(monkeypatch):
    # Step durations 1 s, except a 100 s stall (another process took the cores) and a slow first step.
    durations = iter([50.0] + [1.0] * 5 + [100.0] + [1.0] * 5)
    clock = {"t": 0.0, "start": True}

    def perf_counter():
        if not clock["start"]:
            clock["t"] += next(durations)
        clock["start"] = not clock["start"]
        return clock["t"]

    monkeypatch.setattr(loop, "_clock", perf_counter)
    blocks = torch.randint(64, (16, 8), generator=torch.Generator().manual_seed(0))
    log = loop.train(_tiny_lm(), blocks, steps=12, batch_size=2, lr=1e-3, device="cpu", progress=False)
    assert len(log["step_seconds"]) == 12 - loop.warmup_steps_excluded(12) == 11
    assert log["tokens_per_s"] == pytest.approx(2 * 8 / 1.0)  # the mean would give 16 / 10


def test_demo_table_says_what_tokens_per_s_measures():
    summary = {"results": {"sdpa": {"final_train_loss": 3.0, "eval_loss": 3.1, "tokens_per_s": 1234.0,
                                    "row_sum_residual_median": None}}}
    head = format_table(summary).splitlines()[0]
    assert "tokens/s (median step)" in head


def test_checkpointing_args_raise_no_future_warning():
    from transformers import TrainingArguments

    for enabled in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[], **checkpointing_args(enabled))
        assert not [w for w in caught if "checkpointing" in str(w.message)], [str(w.message) for w in caught]
        flag = getattr(args, "activation_checkpointing", getattr(args, "gradient_checkpointing", None))
        assert flag is enabled


def test_model_without_tokenizer_is_a_complete_one_line_error(tmp_path):
    from hf_fp8_attention.training import load_tokenizer

    _tiny_lm().save_pretrained(tmp_path)
    with pytest.raises(UsageError) as exc:
        load_tokenizer(str(tmp_path))
    message = str(exc.value)
    assert "\n" not in message and not message.rstrip().endswith((":", "(", ",")), message
    assert "tokenizer.save_pretrained" in message and "tokenizer.json" in message
    # Tokenizer files that fail to load: Transformers' whole (multi-line) reason, on one line.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "NoSuchTokenizer"}))
    with pytest.raises(UsageError) as exc:
        load_tokenizer(str(tmp_path))
    assert "\n" not in str(exc.value) and "could not be loaded" in str(exc.value)


def test_bench_help_works_without_a_gpu(capfd, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--help"]) == 0
    out, err = capfd.readouterr()
    assert out.startswith("usage: python -m hf_fp8_attention bench") and "CUDA GPU only" in out
    assert "error" not in err
    if (Path(cli.__file__).resolve().parents[1] / "benchmarks" / "bench_attention.py").exists():
        assert "--seqlens" in out  # the benchmark's own options


def test_demo_help_shows_help_and_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("optimizer steps per run (default: 300 on a GPU, 40 on CPU/--tiny)",
                 "tokens per sequence (default: 1024 on a GPU, 64 on CPU/--tiny)",
                 "model family (default: llama)", "(default: outputs/demo)", "default: sdpa fp8_stale fp8_delta"):
        assert text in out, text


def test_failed_run_leaves_no_empty_output_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()  # exists before: kept

    @main_with_usage_errors
    def failing(argv=None):
        output_dir(argparse.Namespace(output_dir=None, attn="fp8_delta"), "finetune")
        assert (tmp_path / "outputs" / "finetune" / "fp8_delta").is_dir()
        (tmp_path / "outputs" / "finetune" / "fp8_delta" / "trainer").mkdir()  # an empty subfolder
        raise UsageError("bad input")

    with pytest.raises(SystemExit):
        failing()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"] and not any((tmp_path / "outputs").iterdir())

    @main_with_usage_errors
    def crashing(argv=None):
        out = output_dir(argparse.Namespace(output_dir=str(tmp_path / "mine" / "run"), attn="sdpa"), "finetune")
        (out / "partial.log").write_text("kept: the run wrote something")
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError):
        crashing()
    assert (tmp_path / "mine" / "run" / "partial.log").exists()
    assert not errors.created_output_dirs


def test_local_files_load_without_downloading_message(tmp_path, capfd):
    from hf_fp8_attention.training import load_corpus

    data = tmp_path / "docs"
    data.mkdir()
    for i in range(40):  # datasets shows the bar from 16 files on (the default corpus has hundreds)
        (data / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n")
    import datasets

    before = datasets.utils.are_progress_bars_disabled()
    ds = load_corpus(str(data))
    assert len(ds) == 40
    _, err = capfd.readouterr()
    assert "Downloading" not in err, err
    assert datasets.utils.are_progress_bars_disabled() == before  # restored, whatever it was


def test_bf16_on_cpu_is_accepted(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = argparse.Namespace(tiny=False, bf16=True, lr=None, seq_len=None, batch_size=None, max_steps=None,
                              vocab_size=None, grad_accum=1, corpus_bytes=None)
    assert resolve_defaults(args, gpu={}, tiny={"lr": 1e-3}).bf16 is True


def test_fp8_model_trains_under_cpu_bf16_autocast():
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_fp8_attention  # noqa: F401

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                         num_key_value_heads=1, head_dim=64, vocab_size=64, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fp8_delta")
    ids = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
