"""Recipe names with options, as the benchmarks take them: ``recipe+flag`` is the named recipe
(:data:`hf_fp8_attention.RECIPES`) with a boolean config option switched on, e.g.
``fp8_delta_fast+dq_in_stats``, and ``recipe+field=value`` one with a config field set, e.g.
``fp8_delta+ds_scales=tile``; and launch-table entries, ``KEY=VALUE,...``. Also
:func:`fresh_memory_peak`, which the timing scripts call before each measurement, and the
schedule options they share (:func:`add_schedule_options`)."""
from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_fp8_attention import FP8AttentionConfig  # noqa: E402


def fresh_memory_peak() -> None:
    """Reset the device's peak of allocated memory (after a sync) before a measurement. The FP8
    backward chunks only where one pass would raise that peak
    (``kernels.backward.LAUNCH["backward_chunks_below_peak"]``), so without the reset a timed
    call's path would depend on what an earlier config or shape had allocated; from a fresh peak
    it runs as a lone call does."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()


CONFIG_FLAGS = ("dq_in_stats",)  # the boolean options a name may switch on
_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(FP8AttentionConfig)}


def _field_value(field: str, value: str):
    """``value`` as ``field`` takes it: an int or a bool for those fields, else the string (the config
    coerces its enums and names the choices of a bad one)."""
    kind = _FIELD_TYPES[field]
    if kind in ("int", int):
        return int(value)
    if kind in ("bool", bool):
        if value not in ("true", "false"):
            raise ValueError(f"{field}={value!r}: true or false")
        return value == "true"
    return value


def recipe_config(name: str, *, skip: tuple[str, ...] = ()) -> FP8AttentionConfig:
    """The config ``recipe[+flag...][+field=value...]`` names; parts in ``skip`` (a caller's own
    modifiers, such as bench_attention.py's logit modifiers) are left to the caller. A ValueError
    names an unknown recipe, part or field, or a combination the config refuses."""
    recipe, *parts = name.split("+")
    fields = dict(p.partition("=")[::2] for p in parts if "=" in p)
    unknown = [p for p in parts if "=" not in p and p not in CONFIG_FLAGS and p not in skip]
    unknown += [f for f in fields if f not in _FIELD_TYPES]
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; known: {', '.join(CONFIG_FLAGS + skip)}, "
                         f"or field=value for a field of FP8AttentionConfig")
    overrides = {p: True for p in parts if p in CONFIG_FLAGS}
    overrides.update({f: _field_value(f, v) for f, v in fields.items()})
    return FP8AttentionConfig.from_recipe(recipe, **overrides)


def set_table_entries(table: dict, spec: str, table_name: str) -> None:
    """Set entries of a launch table (e.g. ``quantize.ROTATED_LAUNCH``) from ``KEY=VALUE,...``:
    integers, ``True`` / ``False`` or ``None``. A ValueError names a key the table does not have."""
    named = {"None": None, "True": True, "False": False}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in table:
            raise ValueError(f"{key!r} is not an entry of {table_name} ({', '.join(table)})")
        table[key] = named[value] if value in named else int(value)


def apply_launch_tables(parser, quant_spec: str, stats_spec: str, quant_flag: str = "--quant-launch") -> None:
    """``set_table_entries`` on the two launch tables the benchmarks tune: ``quant_spec`` (given as
    ``quant_flag``) on ``quantize.ROTATED_LAUNCH``, ``stats_spec`` (``--stats-launch``) on
    ``sequence_stats.ROTATED_PARTIALS``. A bad entry ends the script through ``parser.error`` naming
    the flag. The kernel modules are imported here, so that a caller may first choose how Triton runs."""
    from hf_fp8_attention.kernels import quantize, sequence_stats

    for flag, spec, table, table_name in (
            (quant_flag, quant_spec, quantize.ROTATED_LAUNCH, "quantize.ROTATED_LAUNCH"),
            ("--stats-launch", stats_spec, sequence_stats.ROTATED_PARTIALS, "sequence_stats.ROTATED_PARTIALS")):
        try:
            set_table_entries(table, spec, table_name)
        except ValueError as err:
            parser.error(f"{flag}: {err}")


# The schedule options that switch one constant of a kernels module on (1) or off (0):
# flag -> (module, constant, help without the constant's name).
ON_OFF_SWITCHES = {
    "--fold-stats": ("sequence_stats", "FOLD_IN_PARTIALS",
                     "1: the sequence statistics folded in their partials launch; 0: a launch of their own"),
    "--quantize-q": ("forward_gluon", "QUANTIZE_Q",
                     "1: the Gluon forward makes the rotated Q's codes itself; 0: a quantization launch before it"),
    "--persistent": ("forward_gluon", "PERSISTENT",
                     "1: the Gluon forward as a persistent kernel; 0: one program per query block"),
    "--hand-over-kv": ("forward", "HAND_OVER_KV_COPIES",
                       "1: the forward makes the backward's K/V copies, saved in place of K and V; 0: the backward "
                       "makes them"),
    "--direct-launch": ("launch", "DIRECT_LAUNCH",
                        "1: the Triton launches through the direct launch path; 0: through Triton's own, whatever "
                        "HF_FP8_ATTENTION_DIRECT_LAUNCH says"),
    "--one-read": ("one_read_prep", "ONE_READ",
                   "1: an operand pair's statistics and copies in one launch where it applies; 0: two launches"),
    "--q-stats-beside-kv": ("forward", "Q_STATS_BESIDE_KV",
                            "1: the forward computes Q's statistics in the K/V statistics launch where Q shares their "
                            "token axis; 0: in a launch of their own"),
    "--keep-fold-counters": ("sequence_stats", "KEEP_FOLD_COUNTERS",
                             "1: the statistics' fold counters kept between launches; 0: fresh zeros (a zeroing "
                             "launch) for every statistics launch"),
}

# The options of add_schedule_options, as the scripts' result headers name them.
SCHEDULE_FLAGS = ", ".join(
    ["`--backward-chunks`", "`--head-group`", "`--chunk-by-size`", "`--fma-exponent [0|1]`", "`--token-major-out 0|1`",
     "`--gluon-forward-d64 0|1`"] + [f"`{flag} 0|1`" for flag in ON_OFF_SWITCHES])


def _on_off_switches():
    """(flag, module, constant) of :data:`ON_OFF_SWITCHES`, the modules imported."""
    return [(flag, importlib.import_module(f"hf_fp8_attention.kernels.{module}"), name)
            for flag, (module, name, _) in ON_OFF_SWITCHES.items()]


def add_schedule_options(parser) -> None:
    """The launch-schedule options the timing scripts share; apply them after parsing with
    :func:`apply_schedule_options`:

    - ``--backward-chunks N``: the FP8 backward in N chunks (``kernels.backward.LAUNCH["backward_chunks"]``;
      1 is one pass);
    - ``--head-group N``: causal Gluon programs dispatched longest first N (batch, head) rows at a time
      (``kernels.gluon_hopper.DISPATCH["head_group"]``; 1 is one row after the other);
    - ``--chunk-by-size``: the FP8 backward in chunks wherever the call is large, whatever the memory
      peak (``kernels.backward.LAUNCH["backward_chunks_below_peak"]`` False), for A/Bs of that rule;
    - ``--fma-exponent [0|1]``: both forwards' one-FMA exponent on (bare flag or 1) or off (0)
      (``kernels.exponent.set_fma_exponent``; by default on in the Gluon forward only);
    - ``--fold-stats 0|1``: the sequence statistics folded in their partials launch, or in a launch
      of their own (``kernels.sequence_stats.FOLD_IN_PARTIALS``);
    - ``--token-major-out 0|1``: both forwards write O token-major where q is, or both contiguous
      (``kernels.forward.TOKEN_MAJOR_OUT`` and ``kernels.forward_gluon.TOKEN_MAJOR_OUT``, both on by
      default);
    - ``--quantize-q 0|1``: the Gluon forward makes the rotated Q's codes itself, or a quantization
      launch makes them before it (``kernels.forward_gluon.QUANTIZE_Q``, on by default);
    - ``--persistent 0|1``: the Gluon forward as a persistent kernel or one program per query block
      (``kernels.forward_gluon.PERSISTENT``, on by default);
    - ``--hand-over-kv 0|1``: the forward makes the backward's K/V copies and hands them over in
      place of the saved K and V, or the backward makes its own (``kernels.forward.HAND_OVER_KV_COPIES``,
      off by default);
    - ``--gluon-forward-d64 0|1``: the Gluon forward at head dim 64 as well as 128, or at 128 only
      (``kernels.forward.GLUON_FORWARD``);
    - ``--direct-launch 0|1``: the Triton launches through the direct launch path or Triton's own,
      whatever ``HF_FP8_ATTENTION_DIRECT_LAUNCH`` says (``kernels.launch.DIRECT_LAUNCH``);
    - ``--one-read 0|1``: an operand pair's statistics and FP8 copies in one launch where it applies,
      or in two (``kernels.one_read_prep.ONE_READ``, off by default): one launch fewer per pair, for
      steps whose forward waits on the host;
    - ``--q-stats-beside-kv 0|1``: the forward's statistics of Q in the K/V statistics launch, or in a
      launch of their own (``kernels.forward.Q_STATS_BESIDE_KV``, on by default);
    - ``--keep-fold-counters 0|1``: the statistics launch's fold counters kept zeroed between
      launches, or fresh zeros for each (``kernels.sequence_stats.KEEP_FOLD_COUNTERS``, on by default)."""
    parser.add_argument("--backward-chunks", type=int, default=None, metavar="N",
                        help="the FP8 backward in N chunks (kernels.backward.LAUNCH['backward_chunks']) for this run")
    parser.add_argument("--head-group", type=int, default=None, metavar="N",
                        help="causal Gluon programs longest first, N (batch, head) rows at a time "
                             "(kernels.gluon_hopper.DISPATCH['head_group']) for this run")
    parser.add_argument("--chunk-by-size", action="store_true",
                        help="the FP8 backward in chunks wherever the call is large, whatever the memory peak "
                             "(kernels.backward.LAUNCH['backward_chunks_below_peak'] = False), for A/Bs")
    parser.add_argument("--fma-exponent", type=int, choices=(0, 1), nargs="?", const=1, default=None,
                        help="1 (or the bare flag): both forwards' one-FMA exponent where its bound allows; 0: the "
                             "exact form everywhere (default: the Gluon forward's only, kernels.exponent)")
    parser.add_argument("--token-major-out", type=int, choices=(0, 1), default=None,
                        help="1: both forwards write O token-major where q is (an attention layer's transpose back "
                             "then copies nothing); 0: both contiguous (kernels.forward.TOKEN_MAJOR_OUT, "
                             "kernels.forward_gluon.TOKEN_MAJOR_OUT)")
    parser.add_argument("--gluon-forward-d64", type=int, choices=(0, 1), default=None,
                        help="1: the Gluon forward at head dim 64 as well as 128; 0: at 128 only, the Triton "
                             "forward at 64 (kernels.forward.GLUON_FORWARD)")
    for flag, (module, name, text) in ON_OFF_SWITCHES.items():
        parser.add_argument(flag, type=int, choices=(0, 1), default=None, help=f"{text} (kernels.{module}.{name})")


def _schedule_tables():
    """(module, attribute) of every switch :func:`apply_schedule_options` may set."""
    from hf_fp8_attention.kernels import backward, exponent, forward, forward_gluon, gluon_hopper

    return ((backward, "LAUNCH"), (gluon_hopper, "DISPATCH"), (exponent, "FMA_EXPONENT"),
            (exponent, "FMA_EXPONENT_TRITON"), (forward, "TOKEN_MAJOR_OUT"), (forward_gluon, "TOKEN_MAJOR_OUT"),
            (forward, "GLUON_FORWARD"), *((module, name) for _, module, name in _on_off_switches()))


def schedule_state() -> tuple:
    """A snapshot of the switches :func:`apply_schedule_options` sets (tables copied), for
    :func:`restore_schedule`: a script that switches them between steps returns to it first."""
    return tuple((module, name, dict(value) if isinstance(value, dict) else value)
                 for module, name in _schedule_tables() for value in (getattr(module, name),))


def restore_schedule(state: tuple) -> None:
    """Put back the switches of a :func:`schedule_state` snapshot (tables in place: the kernels'
    modules hold references to them)."""
    for module, name, value in state:
        if isinstance(value, dict):
            table = getattr(module, name)
            table.clear()
            table.update(value)
        else:
            setattr(module, name, value)


def apply_schedule_options(parser, args) -> str:
    """Set the tables :func:`add_schedule_options`' options name (those given); a value below 1 ends
    the script through ``parser.error``. Returns a note of what was set ("" if nothing), for the
    scripts' headers."""
    from hf_fp8_attention.kernels import backward, exponent, forward, forward_gluon, gluon_hopper

    notes = []
    for flag, value, table, key in (("--backward-chunks", args.backward_chunks, backward.LAUNCH, "backward_chunks"),
                                    ("--head-group", args.head_group, gluon_hopper.DISPATCH, "head_group")):
        if value is None:
            continue
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
        table[key] = value
        notes.append(f"{key}={value}")
    if args.chunk_by_size:
        backward.LAUNCH["backward_chunks_below_peak"] = False
        notes.append("backward_chunks_below_peak=False")
    if args.fma_exponent is not None:
        exponent.set_fma_exponent(bool(args.fma_exponent))
        notes.append(f"FMA_EXPONENT={bool(args.fma_exponent)}")
    if args.token_major_out is not None:
        forward.TOKEN_MAJOR_OUT = forward_gluon.TOKEN_MAJOR_OUT = bool(args.token_major_out)
        notes.append(f"TOKEN_MAJOR_OUT={bool(args.token_major_out)}")
    if args.gluon_forward_d64 is not None:
        forward.GLUON_FORWARD = (64, 128) if args.gluon_forward_d64 else (128, )
        notes.append(f"GLUON_FORWARD={forward.GLUON_FORWARD}")
    for flag, module, name in _on_off_switches():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            setattr(module, name, bool(value))
            notes.append(f"{name}={bool(value)}")
    return " ".join(notes)
