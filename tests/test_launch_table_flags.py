"""The benchmarks' launch-table flags (``bench_attention.py --quant-launch`` and ``--stats-launch``,
``prep_bench.py --set`` and ``--stats-launch``, ``kernel_resources.py --quant-launch`` and
``--stats-launch``) all go through ``recipe_names.set_table_entries``: values parse as integers,
booleans or None, an unknown key is refused by name."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from recipe_names import set_table_entries  # noqa: E402


def test_set_table_entries_parses_ints_and_none():
    table = {"num_warps": 8, "maxnreg": 128, "row_stages": 3}
    set_table_entries(table, "maxnreg=None,row_stages=2", "T")
    assert table == {"num_warps": 8, "maxnreg": None, "row_stages": 2}
    set_table_entries(table, "", "T")
    assert table == {"num_warps": 8, "maxnreg": None, "row_stages": 2}


def test_set_table_entries_parses_booleans():
    table = {"num_warps": 2, "transposed": False}
    set_table_entries(table, "transposed=True,num_warps=4", "T")
    assert table == {"num_warps": 4, "transposed": True}
    set_table_entries(table, "transposed=False", "T")
    assert table["transposed"] is False


def test_set_table_entries_refuses_unknown_key():
    table = {"num_warps": 8}
    with pytest.raises(ValueError, match="'stages' is not an entry of T"):
        set_table_entries(table, "stages=2", "T")
    assert table == {"num_warps": 8}


def test_bench_attention_quant_launch_sets_the_table(monkeypatch):
    pytest.importorskip("triton")
    import bench_attention
    from hf_fp8_attention.kernels import quantize

    monkeypatch.setattr(quantize, "ROTATED_LAUNCH", dict(quantize.ROTATED_LAUNCH))
    args = bench_attention.parse_args(["--quant-launch", "maxnreg=None,row_stages=None", "--modes", "fwd"])
    assert quantize.ROTATED_LAUNCH["maxnreg"] is None and quantize.ROTATED_LAUNCH["row_stages"] is None
    assert args.quant_launch == "maxnreg=None,row_stages=None"
    with pytest.raises(SystemExit):
        bench_attention.parse_args(["--quant-launch", "warps=4"])


def test_bench_attention_stats_launch_sets_the_table(monkeypatch, capsys):
    pytest.importorskip("triton")
    import bench_attention
    from hf_fp8_attention.kernels import sequence_stats

    monkeypatch.setattr(sequence_stats, "ROTATED_PARTIALS", dict(sequence_stats.ROTATED_PARTIALS))
    bench_attention.parse_args(["--stats-launch", "stages=None", "--modes", "fwd"])
    assert sequence_stats.ROTATED_PARTIALS["stages"] is None
    with pytest.raises(SystemExit):
        bench_attention.parse_args(["--stats-launch", "row_stages=2"])
    assert "--stats-launch: 'row_stages' is not an entry of sequence_stats.ROTATED_PARTIALS" in capsys.readouterr().err


def test_bench_attention_backward_chunks_sets_the_table(monkeypatch, capsys):
    pytest.importorskip("triton")
    import bench_attention
    from hf_fp8_attention.kernels import backward

    monkeypatch.setattr(backward, "LAUNCH", dict(backward.LAUNCH))
    bench_attention.parse_args(["--backward-chunks", "3", "--modes", "fwdbwd"])
    assert backward.LAUNCH["backward_chunks"] == 3
    bench_attention.parse_args(["--backward-chunks", "1", "--modes", "fwdbwd"])
    assert backward.LAUNCH["backward_chunks"] == 1
    with pytest.raises(SystemExit):
        bench_attention.parse_args(["--backward-chunks", "0"])
    assert "--backward-chunks must be at least 1, got 0" in capsys.readouterr().err


def test_bench_attention_head_group_sets_the_dispatch_and_the_header(monkeypatch, capsys):
    pytest.importorskip("triton")
    import bench_attention
    from hf_fp8_attention.kernels import backward, gluon_hopper

    monkeypatch.setattr(gluon_hopper, "DISPATCH", dict(gluon_hopper.DISPATCH))
    monkeypatch.setattr(backward, "LAUNCH", dict(backward.LAUNCH))
    args = bench_attention.parse_args(["--head-group", "1", "--modes", "fwdbwd"])
    assert gluon_hopper.DISPATCH["head_group"] == 1
    assert gluon_hopper.head_group(True) == 1 and gluon_hopper.head_group(False) == 1
    assert args.schedule == "head_group=1"
    args = bench_attention.parse_args(["--head-group", "8", "--backward-chunks", "1", "--modes", "fwdbwd"])
    assert gluon_hopper.head_group(True) == 8 and gluon_hopper.head_group(False) == 1
    assert backward.LAUNCH["backward_chunks"] == 1
    env = {"gpu": "GPU", "capability": "sm_90", "torch": "t", "triton": "tr", "cuda": "c", "cudnn": 1,
           "python": "p", "date_utc": "d", "fp8_backward_kernel": "available"}
    assert "Launch schedule set for this run: backward_chunks=1 head_group=8" in bench_attention.render(env, [], args)
    assert backward.LAUNCH["backward_chunks_below_peak"]
    args = bench_attention.parse_args(["--chunk-by-size", "--modes", "fwdbwd"])
    assert not backward.LAUNCH["backward_chunks_below_peak"] and args.schedule == "backward_chunks_below_peak=False"
    with pytest.raises(SystemExit):
        bench_attention.parse_args(["--head-group", "0"])
    assert "--head-group must be at least 1, got 0" in capsys.readouterr().err


def test_bench_attention_fma_exponent_sets_the_switch(monkeypatch):
    pytest.importorskip("triton")
    import bench_attention
    from hf_fp8_attention.kernels import exponent

    monkeypatch.setattr(exponent, "FMA_EXPONENT", True)
    monkeypatch.setattr(exponent, "FMA_EXPONENT_TRITON", False)
    args = bench_attention.parse_args(["--modes", "fwd"])
    assert exponent.FMA_EXPONENT and not exponent.FMA_EXPONENT_TRITON and args.schedule == ""
    args = bench_attention.parse_args(["--fma-exponent", "--modes", "fwd"])
    assert exponent.FMA_EXPONENT_TRITON and args.schedule == "FMA_EXPONENT=True"
    assert exponent.fma_bound() == exponent.fma_bound(triton=True) == exponent.FMA_EXPONENT_BOUND
    args = bench_attention.parse_args(["--fma-exponent", "0", "--modes", "fwd"])
    assert not exponent.FMA_EXPONENT and args.schedule == "FMA_EXPONENT=False"
    assert exponent.fma_bound() == exponent.fma_bound(triton=True) == 0.0


def test_bench_attention_fold_stats_sets_the_switch(monkeypatch):
    pytest.importorskip("triton")
    import bench_attention
    from hf_fp8_attention.kernels import sequence_stats

    default = sequence_stats.FOLD_IN_PARTIALS
    monkeypatch.setattr(sequence_stats, "FOLD_IN_PARTIALS", default)
    assert bench_attention.parse_args(["--modes", "fwd"]).schedule == ""
    assert sequence_stats.FOLD_IN_PARTIALS is default
    for value in (0, 1):
        args = bench_attention.parse_args(["--fold-stats", str(value), "--modes", "fwd"])
        assert sequence_stats.FOLD_IN_PARTIALS is bool(value) and args.schedule == f"FOLD_IN_PARTIALS={bool(value)}"


def test_schedule_option_token_major_out_sets_the_switch(monkeypatch):
    pytest.importorskip("triton")
    import argparse

    import recipe_names
    from hf_fp8_attention.kernels import forward, forward_gluon

    monkeypatch.setattr(forward, "TOKEN_MAJOR_OUT", True)
    monkeypatch.setattr(forward_gluon, "TOKEN_MAJOR_OUT", False)
    parser = argparse.ArgumentParser()
    recipe_names.add_schedule_options(parser)
    assert recipe_names.apply_schedule_options(parser, parser.parse_args([])) == ""
    assert forward.TOKEN_MAJOR_OUT is True and forward_gluon.TOKEN_MAJOR_OUT is False  # left as they were
    for value in (1, 0):
        note = recipe_names.apply_schedule_options(parser, parser.parse_args(["--token-major-out", str(value)]))
        assert forward.TOKEN_MAJOR_OUT is forward_gluon.TOKEN_MAJOR_OUT is bool(value)
        assert note == f"TOKEN_MAJOR_OUT={bool(value)}"


def test_schedule_options_set_their_switches(monkeypatch):
    pytest.importorskip("triton")
    import argparse

    import recipe_names
    from hf_fp8_attention.kernels import forward, forward_gluon, launch, one_read_prep

    monkeypatch.setattr(one_read_prep, "ONE_READ", False)
    monkeypatch.setattr(forward_gluon, "QUANTIZE_Q", True)
    monkeypatch.setattr(forward_gluon, "PERSISTENT", True)
    monkeypatch.setattr(forward, "HAND_OVER_KV_COPIES", True)
    monkeypatch.setattr(forward, "GLUON_FORWARD", (128, ))
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", None)
    monkeypatch.setattr(forward, "Q_STATS_BESIDE_KV", True)
    parser = argparse.ArgumentParser()
    recipe_names.add_schedule_options(parser)
    assert recipe_names.apply_schedule_options(parser, parser.parse_args([])) == ""
    assert forward_gluon.QUANTIZE_Q is True and forward_gluon.PERSISTENT is True  # left as they were
    assert forward.HAND_OVER_KV_COPIES is True and forward.GLUON_FORWARD == (128, ) and launch.DIRECT_LAUNCH is None
    assert one_read_prep.ONE_READ is False
    switches = recipe_names._on_off_switches()
    for _, module, name in switches:  # every switch the loop sets is put back after the test
        monkeypatch.setattr(module, name, getattr(module, name))
    for value in (0, 1):
        for flag, module, name in switches:
            note = recipe_names.apply_schedule_options(parser, parser.parse_args([flag, str(value)]))
            assert getattr(module, name) is bool(value) and note == f"{name}={bool(value)}", flag
        note = recipe_names.apply_schedule_options(parser, parser.parse_args(["--gluon-forward-d64", str(value)]))
        dims = (64, 128) if value else (128, )
        assert forward.GLUON_FORWARD == dims and note == f"GLUON_FORWARD={dims}"


def test_schedule_snapshot_puts_every_switch_back(monkeypatch):
    """``schedule_state`` / ``restore_schedule`` (``step_ab.py``'s variants switch between steps): every
    switch the schedule options set returns to its value, the tables in place (the kernels' modules
    hold them)."""
    pytest.importorskip("triton")
    import argparse

    import recipe_names
    from hf_fp8_attention.kernels import (
        backward, exponent, forward, forward_gluon, gluon_hopper, launch, one_read_prep, sequence_stats,
    )

    def values():
        return (dict(backward.LAUNCH), dict(gluon_hopper.DISPATCH), exponent.FMA_EXPONENT,
                exponent.FMA_EXPONENT_TRITON, sequence_stats.FOLD_IN_PARTIALS, forward.TOKEN_MAJOR_OUT,
                forward_gluon.TOKEN_MAJOR_OUT, forward_gluon.QUANTIZE_Q, forward_gluon.PERSISTENT,
                forward.HAND_OVER_KV_COPIES, forward.GLUON_FORWARD, launch.DIRECT_LAUNCH, one_read_prep.ONE_READ,
                forward.Q_STATS_BESIDE_KV, sequence_stats.KEEP_FOLD_COUNTERS)

    for module, name, value in ((exponent, "FMA_EXPONENT", True), (exponent, "FMA_EXPONENT_TRITON", False),
                                (forward, "TOKEN_MAJOR_OUT", True), (forward_gluon, "TOKEN_MAJOR_OUT", True),
                                (forward_gluon, "QUANTIZE_Q", True), (forward_gluon, "PERSISTENT", True),
                                (forward, "HAND_OVER_KV_COPIES", False), (forward, "GLUON_FORWARD", (128, )),
                                (launch, "DIRECT_LAUNCH", None), (one_read_prep, "ONE_READ", False),
                                (forward, "Q_STATS_BESIDE_KV", True), (sequence_stats, "KEEP_FOLD_COUNTERS", True)):
        monkeypatch.setattr(module, name, value)  # a known start, whatever the defaults become
    before, launch_table, dispatch_table = values(), backward.LAUNCH, gluon_hopper.DISPATCH
    state = recipe_names.schedule_state()
    parser = argparse.ArgumentParser()
    recipe_names.add_schedule_options(parser)
    flags = ["--backward-chunks", "3", "--head-group", "7", "--chunk-by-size", "--fma-exponent", "0",
             "--fold-stats", str(int(not sequence_stats.FOLD_IN_PARTIALS)), "--token-major-out", "0",
             "--quantize-q", "0", "--persistent", "0", "--hand-over-kv", "1", "--gluon-forward-d64", "1",
             "--direct-launch", "1", "--one-read", "1", "--q-stats-beside-kv", "0", "--keep-fold-counters", "0"]
    try:
        recipe_names.apply_schedule_options(parser, parser.parse_args(flags))
        changed = values()
        # every switch but the Triton forward's exponent (--fma-exponent 0 sets both to False: it was off)
        assert [a != b for a, b in zip(before, changed)] == [True, True, True, False, True, True, True, True,
                                                             True, True, True, True, True, True, True], changed
    finally:
        recipe_names.restore_schedule(state)
    assert values() == before
    assert backward.LAUNCH is launch_table and gluon_hopper.DISPATCH is dispatch_table


def test_kernel_resources_labels_statistics_launches_by_operand():
    """Two statistics launches that compute different things per operand get rows of their own."""
    import kernel_resources

    flags = {"SUB": 32, "TRANSPOSED": True, "X_ROTATE": True, "X_EXT": True, "X_SUM": True, "X_AMAX": True,
             "Y_ROTATE": False, "Y_EXT": False, "Y_SUM": False, "Y_AMAX": True}
    kv = {"kernel": "_partials_kernel", "consts": flags}
    k_alone = {"kernel": "_partials_kernel", "consts": {**flags, "Y_AMAX": False}}
    assert kernel_resources.full_label(kv) == "stats partials sub32 transposed X:Resa Y:a"
    assert kernel_resources.full_label(k_alone) == "stats partials sub32 transposed X:Resa Y:"
    kvq = {"kernel": "_partials_kernel", "consts": {**flags, "Z_OP": True, "Z_ROTATE": True, "Z_EXT": True}}
    assert kernel_resources.full_label(kvq) == "stats partials sub32 transposed X:Resa Y:a Z:Re"
    quant = {"kernel": "quantize_kernel", "consts": {"X_ROTATE": True, "Y_ROTATE": False, "ROW_CHUNK": 64,
                                                     "COL_GROUP": 64, "X_ROW": True, "X_COL": False, "Y_ROW": False,
                                                     "Y_COL": True}}
    assert kernel_resources.full_label(quant) == "quantize rotated rows64/cols64 X:r Y:c"
