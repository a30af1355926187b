"""``benchmarks/step_ab.py``: training steps of one model alternating between attention implementations,
each implementation's speed the median of per-round ratios to the reference's."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
step_ab = pytest.importorskip("step_ab")


def test_rounds_rotate_so_every_implementation_takes_every_position():
    orders = step_ab.round_orders(["a", "b", "c"], 6)
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]] and orders[3:] == orders[:3]
    for position in range(3):
        assert sorted(order[position] for order in orders) == ["a", "a", "b", "b", "c", "c"]


def test_ratios_pair_each_round_so_a_shared_drift_cancels():
    # Round 2 runs 10% slower for both: each round's ratio is 0.8, the unpaired medians would not say so.
    times = {"sdpa": [100.0, 110.0, 100.0], "fp8": [125.0, 137.5, 125.0]}
    ratios = step_ab.paired_ratios(times, "sdpa")
    assert ratios["sdpa"] == [1.0, 1.0, 1.0] and ratios["fp8"] == pytest.approx([0.8, 0.8, 0.8])
    assert step_ab.quartiles([3.0]) == (3.0, 3.0, 3.0)
    assert step_ab.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)


def test_every_timed_step_runs_the_implementation_it_is_timed_as(tmp_path, monkeypatch):
    """The tiny model on CPU: the FP8 attention function runs in exactly the FP8 steps (2 layers per
    forward), the table and JSON hold one row per implementation and every loss is finite."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import hf_fp8_attention  # noqa: F401  (registers fp8_delta)

    calls = {"n": 0}
    wrapped = ALL_ATTENTION_FUNCTIONS["fp8_delta"]

    def counting(*args, **kwargs):
        calls["n"] += 1
        return wrapped(*args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "fp8_delta", counting)
    assert step_ab.main(["--tiny", "--rounds", "2", "--warmup", "1", "--attn", "sdpa,fp8_delta",
                         "--out-dir", str(tmp_path), "--tag", "ab"]) == 0
    assert calls["n"] == 2 * (1 + 2)  # 2 layers x (1 warm-up + 2 timed fp8 steps)
    data = json.loads((tmp_path / "ab.json").read_text())
    assert [r["attn"] for r in data["rows"]] == ["sdpa", "fp8_delta"] and data["rows"][0]["x_ref"] == 1.0
    assert len(data["times_ms"]["fp8_delta"]) == 2 and len(data["losses"]) == 4
    text = (tmp_path / "ab.md").read_text()
    assert "| attention | ms/step (median) | tokens/s | x sdpa | q1-q3 |" in text
    assert "| fp8_delta |" in text


def test_a_variant_sets_its_switches_for_its_own_steps_only(tmp_path, monkeypatch):
    """``IMPL@token-major-out=0``: the same implementation with a kernel switch of its own, set
    before each of its steps and put back after; the run leaves every switch as it found it."""
    pytest.importorskip("triton")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import hf_fp8_attention  # noqa: F401
    from hf_fp8_attention.kernels import forward, forward_gluon

    seen = []
    wrapped = ALL_ATTENTION_FUNCTIONS["fp8_delta"]

    def recording(*args, **kwargs):
        seen.append((forward.TOKEN_MAJOR_OUT, forward_gluon.TOKEN_MAJOR_OUT))
        return wrapped(*args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "fp8_delta", recording)
    before = (forward.TOKEN_MAJOR_OUT, forward_gluon.TOKEN_MAJOR_OUT)
    assert step_ab.main(["--tiny", "--rounds", "2", "--warmup", "1", "--out-dir", str(tmp_path), "--tag", "ab",
                         "--attn", "fp8_delta,fp8_delta@token-major-out=0"]) == 0
    assert seen.count((True, True)) == seen.count((False, False)) == 2 * (1 + 2) and len(seen) == 12
    assert (forward.TOKEN_MAJOR_OUT, forward_gluon.TOKEN_MAJOR_OUT) == before == (True, True)
    data = json.loads((tmp_path / "ab.json").read_text())
    assert [r["attn"] for r in data["rows"]] == ["fp8_delta", "fp8_delta@token-major-out=0"]


def test_a_variant_with_an_unknown_option_or_a_bad_value_is_refused(capsys):
    pytest.importorskip("triton")
    with pytest.raises(SystemExit):
        step_ab.main(["--tiny", "--attn", "sdpa,fp8_delta@no-such-switch=1"])
    assert "unrecognized arguments: --no-such-switch 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        step_ab.main(["--tiny", "--attn", "sdpa,fp8_delta@backward-chunks=0"])
    assert "--backward-chunks must be at least 1, got 0" in capsys.readouterr().err


def test_one_implementation_or_a_repeat_is_refused(capsys):
    for attn in ("sdpa", "sdpa,sdpa"):
        with pytest.raises(SystemExit):
            step_ab.main(["--tiny", "--attn", attn])
        assert "--attn needs at least two different implementations" in capsys.readouterr().err
