"""``benchmarks/stale_coherence.py``: its running sums, and the script end to end on a tiny random Llama."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import stale_coherence  # noqa: E402


def test_mean_pairwise_cosine_from_the_sum_of_unit_vectors():
    torch.manual_seed(0)
    u = torch.randn(5, 40)
    unit = u / u.norm(dim=1, keepdim=True)
    cos = unit @ unit.T
    expected = float((cos.sum() - cos.diagonal().sum()) / (5 * 4))
    assert stale_coherence.mean_pairwise_cosine(unit.sum(dim=0), 5) == pytest.approx(expected, abs=1e-6)


def test_running_sums_tell_a_shared_error_from_noise():
    """Errors made of one shared direction plus noise keep a coherence near the shared part's
    squared share (here 0.5) and a summed error as large as each batch's; pure noise's coherence is
    ~0 and its summed error shrinks like 1/sqrt(n) against a shared gradient."""
    torch.manual_seed(0)
    size, n = 20000, 16
    shared_g, shared_e = torch.randn(size), torch.randn(size)
    sums = stale_coherence.RunningSums(size)
    for _ in range(n):
        g = shared_g + 0.1 * torch.randn(size)
        sums.add({"g": g, "e_m": 0.05 * (shared_e + torch.randn(size)), "e_s": 0.05 * torch.randn(size)})
    row = sums.summary()
    assert row["batches"] == n
    assert row["coherence_g"] > 0.98
    assert row["coherence_e_m"] == pytest.approx(0.5, abs=0.02)
    assert abs(row["coherence_e_s"]) < 0.02
    assert all(c == pytest.approx(0.5, abs=0.03) for c in row["coherence_e_m_halves"])
    assert all(abs(c) < 0.03 for c in row["coherence_e_s_halves"])
    assert row["accumulated_e_m"] == pytest.approx(row["per_batch_e_m"] / 2 ** 0.5 * (1 + 1 / n) ** 0.5, rel=0.05)
    assert row["accumulated_e_s"] == pytest.approx(row["per_batch_e_s"] / n ** 0.5, rel=0.05)
    assert row["accumulated_e_s"] == pytest.approx(row["independent_e_s"], rel=0.05)
    assert row["accumulated_e_m"] > 2.5 * row["independent_e_m"]  # sqrt((n + 1) / 2) = 2.9 for n = 16
    # The shared error is orthogonal to the shared gradient (independent random directions in 20000 dims).
    assert abs(row["cos_summed_e_m_g"]) < 0.05 and abs(row["cos_summed_e_s_g"]) < 0.05


def test_running_sums_refuse_a_vector_without_a_direction():
    sums = stale_coherence.RunningSums(3)
    with pytest.raises(ValueError, match="e_s"):
        sums.add({"g": torch.ones(3), "e_m": torch.ones(3), "e_s": torch.zeros(3)})
    assert sums.n == 0 and not sums.sum["g"].any() and not sums.square_sum["g"]  # a refused batch leaves nothing
    with pytest.raises(ValueError, match="non-finite"):
        sums.add({"g": torch.tensor([1.0, float("nan"), 0.0]), "e_m": torch.ones(3), "e_s": torch.ones(3)})


def test_running_sums_tell_a_shortening_error_by_its_direction():
    torch.manual_seed(0)
    sums = stale_coherence.RunningSums(1000)
    for _ in range(4):
        g = torch.randn(1000)
        sums.add({"g": g, "e_m": -0.1 * g, "e_s": 0.1 * g + 0.01 * torch.randn(1000)})
    row = sums.summary()
    assert row["cos_summed_e_m_g"] == pytest.approx(-1.0, abs=1e-6)
    assert row["cos_summed_e_s_g"] > 0.99


def test_every_matched_recipe_gets_its_stale_twin():
    from hf_fp8_attention import registered_fp8_config
    from hf_fp8_attention.config import DeltaMode, Granularity

    assert stale_coherence.register_pair("fp8_delta") == ("fp8_delta", "fp8_stale")
    assert stale_coherence.register_pair("hybrid_delta") == ("hybrid_delta", "hybrid_stale")
    name, twin = stale_coherence.register_pair("fp8_delta+ds_scales=tile")
    assert (name, twin) == ("fp8_delta__ds_scales_tile", "fp8_delta__ds_scales_tile_stale_twin")
    assert registered_fp8_config(name).ds_scales is Granularity.TILE
    assert registered_fp8_config(twin) == registered_fp8_config(name).replace(delta=DeltaMode.STALE)
    with pytest.raises(ValueError, match="stale delta"):
        stale_coherence.register_pair("fp8_stale")


def test_running_sums_without_the_stale_twin():
    sums = stale_coherence.RunningSums(3, kinds=("g", "e_m"))
    sums.add({"g": torch.tensor([1.0, 0.0, 0.0]), "e_m": torch.tensor([0.0, 1.0, 0.0])})
    sums.add({"g": torch.tensor([1.0, 1.0, 0.0]), "e_m": torch.tensor([0.0, 1.0, 0.0])})
    row = sums.summary()
    assert row["coherence_e_m"] == pytest.approx(1.0) and row["coherence_g"] == pytest.approx(0.5 ** 0.5)
    assert not any("e_s" in key for key in row)


def test_tiny_model_end_to_end(tmp_path):
    assert stale_coherence.main(["--tiny", "--batches", "3", "--tokens", "32", "--corpus-bytes", "200000",
                                 "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "stale_coherence.json").read_text())
    assert (tmp_path / "stale_coherence.png").stat().st_size > 0
    row = data["results"]["fp8_delta"]
    assert row["batches"] == 3 and len(data["curves"]["fp8_delta"]) == 3
    # The twins share every code but D: what the stale one adds is small but not zero.
    assert 0 < row["per_batch_e_s"] < row["per_batch_e_m"]


def test_tiny_model_without_twins_and_split(tmp_path):
    """A field-set recipe, no stale twin, each window as a batch of 4 sequences: the same sdpa
    gradients' coherence whatever the FP8 recipe."""
    assert stale_coherence.main(["--tiny", "--batches", "3", "--tokens", "32", "--split", "4",
                                 "--recipes", "hybrid_delta,fp8_delta+ds_scales=tile", "--no-twins",
                                 "--corpus-bytes", "200000", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "stale_coherence.json").read_text())
    hybrid, tile = data["results"]["hybrid_delta"], data["results"]["fp8_delta+ds_scales=tile"]
    assert hybrid["coherence_g"] == tile["coherence_g"]
    assert 0 < hybrid["per_batch_e_m"] and 0 < tile["per_batch_e_m"] and "per_batch_e_s" not in tile
    assert (tmp_path / "stale_coherence.png").stat().st_size > 0


def test_split_windows_hold_the_same_tokens_in_shorter_sequences():
    tokens = torch.arange(100)
    whole = stale_coherence.batches(tokens, 3, 8)
    split = stale_coherence.batches(tokens, 3, 8, split=4)
    assert [w.shape for w in split] == [(4, 2)] * 3
    for w, s in zip(whole, split):
        assert torch.equal(w.reshape(-1), s.reshape(-1))
    with pytest.raises(ValueError, match="does not split"):
        stale_coherence.batches(tokens, 3, 8, split=3)


def test_rejects_unknown_recipes_and_too_few_batches():
    with pytest.raises(SystemExit):
        stale_coherence.main(["--tiny", "--recipes", "fp8_stale"])
    with pytest.raises(SystemExit):
        stale_coherence.main(["--tiny", "--batches", "1"])
    with pytest.raises(SystemExit):
        stale_coherence.main(["--tiny", "--tokens", "8", "--split", "3"])
    with pytest.raises(ValueError, match="windows"):
        stale_coherence.batches(torch.arange(10), 3, 4)
