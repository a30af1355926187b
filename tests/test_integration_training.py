"""Training with attn_implementation="fp8_delta": Trainer (padded and packed batches), gradient
checkpointing, PEFT LoRA (train, merge_and_unload) and save_pretrained/from_pretrained.

Tiny models from configs (test_integration_models.tiny_model), a word-level tokenizer built in
memory, a few optimizer steps on CPU: these check that everything runs, trains and round-trips,
with tolerances from test_integration_models (FP8_LOGITS_BUDGET, TIGHT).

``datasets``, ``peft`` and ``accelerate`` (the Trainer) are optional (the ``train`` extra): the
tests that need one skip without it, the others still run (test_optional_imports.py checks this).
"""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    AutoModelForCausalLM,
    DataCollatorForLanguageModeling,
    DataCollatorWithFlattening,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

from hf_fp8_attention.integration import transformers_backend
from hf_fp8_attention.training.models import enable_checkpointing
from hf_fp8_attention.training.recipe import checkpointing_args
from test_integration_models import TIGHT, VOCAB, rel, tiny_model, tokens


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>")


def _dataset(n=16):
    Dataset = pytest.importorskip("datasets").Dataset
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(8, 33, (n,), generator=g).tolist()
    return Dataset.from_dict({"input_ids": [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lengths]})


def _count_fp8_calls(monkeypatch) -> list:
    calls = []
    real = transformers_backend.fp8_attention
    monkeypatch.setattr(transformers_backend, "fp8_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _train(model, collator, tmp_path, steps=3, **args):
    pytest.importorskip("accelerate")  # Trainer needs it
    settings = dict(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
    )
    arguments = TrainingArguments(**{**settings, **args})
    trainer = Trainer(model=model, args=arguments, train_dataset=_dataset(), data_collator=collator)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == steps and all(torch.isfinite(torch.tensor(losses)))
    return trainer


@pytest.mark.parametrize(
    "batching", ["padded", "packed", "padded_checkpointing"],
)
def test_trainer_steps(batching, tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    pytest.importorskip("accelerate")
    calls = _count_fp8_calls(monkeypatch)
    model = tiny_model("qwen2")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if batching == "packed":
        collator = DataCollatorWithFlattening()
    else:
        collator = DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
    extra = checkpointing_args(True) if batching.endswith("checkpointing") else {}
    _train(model, collator, tmp_path, **extra)
    assert calls, "the FP8 attention function must run"
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert any("self_attn.q_proj" in n for n in changed) and any("self_attn.k_proj" in n for n in changed)


def test_gradient_checkpointing_gives_the_same_gradients():
    """Recomputing the FP8 forward in the backward is deterministic, so checkpointing changes nothing."""
    model = tiny_model("llama")
    model.train()
    x = tokens(2, 24)

    def grads():
        model.zero_grad()
        model(x, labels=x).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    enable_checkpointing(model)  # non-reentrant, under the name this Transformers uses (no FutureWarning)
    checkpointed = grads()
    assert all(torch.equal(plain[n], checkpointed[n]) for n in plain)


def test_peft_lora_train_and_merge(tmp_path, monkeypatch):
    peft = pytest.importorskip("peft")
    pytest.importorskip("datasets")
    pytest.importorskip("accelerate")
    LoraConfig, get_peft_model = peft.LoraConfig, peft.get_peft_model
    calls = _count_fp8_calls(monkeypatch)
    base = tiny_model("llama")
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(base, lora)
    _train(model, DataCollatorForLanguageModeling(_tokenizer(), mlm=False), tmp_path, steps=4, learning_rate=2e-2)
    assert calls
    lora_b = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    # lora_B starts at zero: non-zero after training means gradients flowed through FP8 attention
    # into the q/k/v adapters (k_proj's only path to the loss is the attention logits).
    assert any("k_proj" in n and p.abs().max() > 0 for n, p in lora_b.items())
    model.eval()
    x = tokens(2, 24, seed=9)
    with torch.no_grad():
        adapted = model(x).logits
        with model.disable_adapter():
            plain = model(x).logits
        merged = model.merge_and_unload()
        merged_logits = merged(x).logits
    assert merged.config._attn_implementation == "fp8_delta"
    # Merging changes the weights by fp32 rounding only, which can flip a few FP8 roundings: TIGHT.
    # The adapters' own effect is far larger, so a merge that dropped them would fail.
    assert rel(merged_logits, adapted) < TIGHT
    assert rel(plain, adapted) > 100 * TIGHT


def test_save_pretrained_round_trip(tmp_path):
    model = tiny_model("qwen3")
    x = tokens(1, 20)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="fp8_delta")
    assert loaded.config._attn_implementation == "fp8_delta"
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    # Transformers does not serialise the attention implementation: it is chosen at load time.
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation != "fp8_delta"
