"""The examples end to end in their tiny CPU setting (subprocesses, offline), and their bad-input errors.

Each run trains a 2-layer model (hidden 128, head_dim 64) for a handful of steps on a 300 kB slice of
the standard-library corpus. "The loss decreases" compares the mean of the first and last quarter
of the logged losses: from random init (loss ~ ln(vocab) = 7.6) a handful of steps at lr 2e-3 lowers
it by far more than step-to-step noise, so a broken backward (no update, wrong gradients) fails.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TINY = ["--tiny", "--no-progress", "--corpus-bytes", "300000", "--batch-size", "4"]
# The matched backward's row sums are fp32 rounding (~1e-7); the stale delta's are ~1e-2 (see
# hf_fp8_attention/cli.py for the bound's reasoning).
MATCHED_MAX, STALE_MIN = 1e-5, 1e-4


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return {**os.environ, "HF_FP8_ATTENTION_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}


def run(script: str, args: list[str], env: dict, timeout: int = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], env=env, cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)
    return proc


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    assert "=== summary ===" in proc.stdout


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def assert_trained(s: dict, out: Path, png: str = "loss_curve.png") -> None:
    assert (out / png).stat().st_size > 1000
    assert s["loss_last_quarter"] < s["loss_first_quarter"] - 0.1, s


@pytest.fixture(scope="module")
def finetuned(env, tmp_path_factory):
    """Full fine-tuning, padded batches, sdpa: also the local checkpoint the --model tests load."""
    out = tmp_path_factory.mktemp("ft_sdpa")
    proc = run("finetune.py", [*TINY, "--attn", "sdpa", "--max-steps", "10", "--output-dir", str(out)], env)
    ok(proc)
    return out


def test_finetune_full_padded_sdpa(finetuned):
    s = summary(finetuned)
    assert_trained(s, finetuned)
    assert s["attn_implementation"] == "sdpa" and not s["lora"] and not s["packed"]
    assert (finetuned / "final" / "config.json").exists() and (finetuned / "final" / "tokenizer.json").exists()


def test_finetune_lora_packed_checkpointing_fp8_delta(env, tmp_path):
    proc = run("finetune.py", [*TINY, "--attn", "fp8_delta", "--lora", "--packed", "--gradient-checkpointing",
                               "--max-steps", "10", "--lr", "1e-2", "--output-dir", str(tmp_path)], env)
    ok(proc)
    s = summary(tmp_path)
    assert_trained(s, tmp_path)
    assert s["attn_implementation"] == "fp8_delta" and s["lora"] and s["packed"] and s["gradient_checkpointing"]
    assert 0 < s["trainable"] < s["params"] / 5  # only the adapters train


def test_finetune_from_local_checkpoint_fp8_stale(env, finetuned, tmp_path):
    proc = run("finetune.py", [*TINY, "--model", str(finetuned / "final"), "--attn", "fp8_stale", "--max-steps", "4",
                               "--no-save", "--output-dir", str(tmp_path)], env)
    ok(proc)
    s = summary(tmp_path)
    assert s["attn_implementation"] == "fp8_stale" and s["model"] == str(finetuned / "final")


def run_ddp(args: list[str], env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    """continued_pretraining.py on 2 CPU processes (torchrun + gloo): the DDP code path of the example."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(EXAMPLES / "continued_pretraining.py"), *args]
    return subprocess.run(cmd, env={**env, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}, cwd=ROOT,
                          text=True, capture_output=True, timeout=timeout)


def test_continued_pretraining_ddp_resume_matches_uninterrupted_run(env, tmp_path):
    args = [*TINY, "--attn", "fp8_stale", "--max-steps", "8", "--save-every", "4"]
    ok(run_ddp([*args, "--output-dir", str(tmp_path / "a")], env))
    a = summary(tmp_path / "a")
    assert_trained(a, tmp_path / "a")
    assert a["num_processes"] == 2 and "MULTI_CPU" in a["distributed_type"]
    assert (tmp_path / "a" / "checkpoints" / "step_4").is_dir() and (tmp_path / "a" / "final" / "config.json").exists()
    ok(run_ddp([*args, "--resume", str(tmp_path / "a" / "checkpoints" / "step_4"), "--output-dir", str(tmp_path / "b")], env))
    b = summary(tmp_path / "b")
    assert b["resumed_from"] and len(b["losses"]) == 8
    # Same state (weights, optimizer, schedule, both ranks' RNG) and the same data order: the same
    # losses, up to reduction-order noise (none in practice on CPU; 1e-5 is generous).
    assert b["losses"] == pytest.approx(a["losses"], rel=1e-5)


def test_context_extension_fp8_delta(env, tmp_path):
    proc = run("context_extension.py", [*TINY, "--attn", "fp8_delta", "--base-steps", "10", "--max-steps", "6",
                                        "--output-dir", str(tmp_path)], env)
    ok(proc)
    s = summary(tmp_path)
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000
    assert s["seq_len"] == 4 * s["base_len"] and s["rope_type"] == "yarn" and s["gradient_checkpointing"]
    assert s["eval_loss_after"] < s["eval_loss_before"]
    res = s["row_sum_residual_median"]
    for length in (s["base_len"], s["seq_len"]):
        assert res[f"fp8_delta@{length}"] < MATCHED_MAX < STALE_MIN < res[f"fp8_stale@{length}"]
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["max_position_embeddings"] == s["seq_len"]


# --- bad input: one line on stderr, exit code 2, no traceback -------------------------------------------

def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_line_error(capsys, fn, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        fn(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_missing_model_path_is_one_line_in_a_subprocess(env, tmp_path):
    proc = run("finetune.py", [*TINY, "--model", str(tmp_path / "nope")], env, timeout=120)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "no such directory" in err[0] and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", ["finetune", "continued_pretraining", "context_extension"])
def test_bad_inputs(name, tmp_path, capsys, monkeypatch, finetuned):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    main = _load_example(name).main
    base = [*TINY, "--output-dir", str(tmp_path / "out")]
    assert "no such directory" in _one_line_error(capsys, main, [*base, "--model", str(tmp_path / "missing")])
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert "'gpt2' is not supported" in _one_line_error(capsys, main, [*base, "--model", str(gpt2)])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert "empty" in _one_line_error(capsys, main, [*base, "--data", str(empty)])
    too_long = ["--seq-len", "4096"] if name != "context_extension" else ["--base-len", "4096"]
    err = _one_line_error(capsys, main, [*base, "--model", str(finetuned / "final"), *too_long])
    assert "exceeds the model's max_position_embeddings (64)" in err
    assert "must be a positive integer" in _one_line_error(capsys, main, [*base, "--max-steps", "0"])


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_config_of_every_family_trains_with_fp8_delta(family):
    """Each family the examples accept builds at head_dim 64 and gets finite FP8 gradients everywhere."""
    import torch

    from hf_fp8_attention.training import build_model, tiny_config

    config = tiny_config(family, "tiny", vocab_size=512, max_position_embeddings=64)
    assert config.head_dim == 64 and config.num_attention_heads == 2 * config.num_key_value_heads
    model = build_model(config, "fp8_delta", seed=0)
    assert model.config._attn_implementation == "fp8_delta"
    ids = torch.randint(512, (2, 48), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    q_proj = model.model.layers[0].self_attn.q_proj.weight.grad
    assert float(q_proj.abs().sum()) > 0  # gradients reach the attention projections through the FP8 op


def test_user_data_formats_load_through_datasets(tmp_path):
    """--data: JSON lines (any text column), a directory of text files, a save_to_disk DatasetDict."""
    import datasets

    from hf_fp8_attention.training import UsageError, load_corpus

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"body": "def f(x):\\n    return x"}\n{"body": "class A:\\n    pass"}\n{"body": "  "}\n')
    ds = load_corpus(str(jsonl), text_column="body")
    assert ds.column_names == ["text"] and ds["text"] == ["def f(x):\n    return x", "class A:\n    pass"]
    with pytest.raises(UsageError, match="no 'text' column"):
        load_corpus(str(jsonl))
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "a.txt").write_text("first document\nsecond line")
    (folder / "b.md").write_text("# second document")
    assert sorted(load_corpus(str(folder))["text"]) == ["# second document", "first document\nsecond line"]
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x = 1", "y = 2"]})}).save_to_disk(str(saved))
    assert load_corpus(str(saved))["text"] == ["x = 1", "y = 2"]
    (tmp_path / "model.bin").write_bytes(b"\0")
    with pytest.raises(UsageError, match="unsupported file type"):
        load_corpus(str(tmp_path / "model.bin"))


def test_packages_corpus_reads_installed_sources_in_a_fixed_order(tmp_path, monkeypatch):
    """--data packages:NAME,...: each package's .py files (test folders left out) sorted by path, the
    packages in the order given, located without importing them; bad names refused by name; the
    parity runs record the packages' versions (only for such a corpus, so older run folders resume)."""
    import argparse

    from hf_fp8_attention.training import UsageError, load_corpus, package_versions

    root = tmp_path / "site"
    files = {"corpuspkg/__init__.py": "raise RuntimeError('imported')",  # importing it would fail
             "corpuspkg/b.py": "B = 2", "corpuspkg/sub/a.py": "A = 1", "corpuspkg/sub/empty.py": "",
             "corpuspkg/tests/test_a.py": "assert A", "corpuspkg/data.json": "{}", "corpusmod.py": "M = 0"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.syspath_prepend(str(root))
    ds = load_corpus("packages:corpuspkg,corpusmod")
    assert ds["text"] == ["raise RuntimeError('imported')", "B = 2", "A = 1", "M = 0"]
    assert load_corpus("packages:corpusmod, corpuspkg")["text"][0] == "M = 0"
    for spec, message in (("packages:no_such_pkg_xyz", "'no_such_pkg_xyz' is not an installed top-level package"),
                          ("packages:corpuspkg.sub", "'corpuspkg.sub' is not an installed top-level package"),
                          ("packages:", "name at least one installed package")):
        with pytest.raises(UsageError, match=message):
            load_corpus(spec)
    torch = pytest.importorskip("torch")
    assert package_versions(["torch", "corpuspkg"]) == {"torch": torch.__version__, "corpuspkg": "?"}
    parity = _load_example("parity")
    assert parity._settings(argparse.Namespace(data="packages:corpusmod"))["corpus_versions"] == {"corpusmod": "?"}
    assert "corpus_versions" not in parity._settings(argparse.Namespace(data=None))


def test_tokenizer_is_trained_once_and_cached(tmp_path, monkeypatch):
    from hf_fp8_attention.training import load_corpus, train_tokenizer

    monkeypatch.setenv("HF_FP8_ATTENTION_CACHE", str(tmp_path))
    corpus = load_corpus(max_bytes=100_000)
    first = train_tokenizer(corpus, 512, show_progress=False)
    cached = list(tmp_path.glob("tokenizers/*/tokenizer.json"))
    assert len(cached) == 1
    mtime = cached[0].stat().st_mtime_ns
    second = train_tokenizer(corpus, 512, show_progress=False)
    assert cached[0].stat().st_mtime_ns == mtime and second.get_vocab() == first.get_vocab()
    assert len(first) == 512 and first.eos_token == "</s>" and first.pad_token == "<pad>"
    text = "import os\nprint(os.getcwd())"
    assert first.decode(first(text)["input_ids"]) == text  # byte-level BPE round-trips source text
