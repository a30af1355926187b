"""Text corpora as ``datasets.Dataset`` objects with one ``text`` column.

The default corpus is the Python standard library's own sources: real text that exists on every
machine with Python, so the examples run offline on a fresh install. ``--data`` accepts the user's
files (text, JSON lines, CSV, Parquet), a dataset saved with ``Dataset.save_to_disk``, or
``packages:NAME,...``: the Python sources of installed packages (``packages:torch,transformers`` is
~100 MB, 8-10 times the standard library's, for runs that should not repeat their corpus).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sysconfig
from importlib import metadata
from pathlib import Path

from .errors import UsageError

# Vendored or test-only directories: kept out so the corpus is the library's own code and docs.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "ensurepip"}
_TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".text"}
_BUILDER_BY_SUFFIX = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
PACKAGES_PREFIX = "packages:"


def _python_sources(root: Path) -> list[Path]:
    """``*.py`` files under ``root`` (vendored and test folders left out), sorted by relative path."""
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def stdlib_source_files(max_bytes: int | None = None) -> list[Path]:
    """The standard library's ``*.py`` files in a fixed order, up to ``max_bytes`` in total."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _python_sources(root)
    if not files:
        raise UsageError(f"no Python sources found under the standard library directory {root}; pass --data")
    return _capped(files, max_bytes)


def package_names(data: str | None) -> list[str] | None:
    """The package names of a ``packages:NAME,...`` corpus spec; None for any other ``data`` (a file or
    folder of that name included)."""
    if data is None or not data.startswith(PACKAGES_PREFIX) or Path(data).expanduser().exists():
        return None
    names = [n.strip() for n in data[len(PACKAGES_PREFIX):].split(",") if n.strip()]
    if not names:
        raise UsageError(f"--data {data}: name at least one installed package (e.g. packages:torch,transformers)")
    return names


def package_source_files(names: list[str], max_bytes: int | None = None) -> list[Path]:
    """The ``*.py`` files of the installed packages ``names`` (import names), package by package in the
    order given, each package's files sorted by path; up to ``max_bytes`` in total. The packages are
    located, not imported."""
    files: list[Path] = []
    for name in names:
        try:  # a dotted name would import its parents, so only top-level names are looked up
            spec = importlib.util.find_spec(name) if "." not in name else None
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            raise UsageError(f"--data {PACKAGES_PREFIX}: {name!r} is not an installed top-level package")
        if spec.submodule_search_locations:
            found = [f for root in spec.submodule_search_locations for f in _python_sources(Path(root))]
        else:
            found = [Path(spec.origin)] if spec.origin and spec.origin.endswith(".py") else []
        if not found:
            raise UsageError(f"--data {PACKAGES_PREFIX}: package {name!r} has no Python sources")
        files.extend(found)
    return _capped(files, max_bytes)


def package_versions(names: list[str]) -> dict[str, str]:
    """``{import name: installed version}`` of a packages corpus, which identify its text ("?" where no
    distribution metadata names the package)."""
    dists = _distributions()
    return {name: metadata.version(dists[name][0]) if name in dists else "?" for name in names}


@functools.lru_cache(maxsize=1)
def _distributions() -> dict:
    """``{import name: [distribution names]}`` of the installed packages: a scan of every
    distribution's metadata (~0.2 s), which a parity command would otherwise repeat for each run."""
    return metadata.packages_distributions()


def _capped(files: list[Path], max_bytes: int | None) -> list[Path]:
    """The first files up to ``max_bytes`` in total (once some are chosen, larger ones are skipped)."""
    if max_bytes is None:
        return files
    chosen, total = [], 0
    for path in files:
        size = path.stat().st_size
        if size == 0:
            continue
        if total + size > max_bytes and chosen:
            continue  # skip big files once some are chosen; keep going for smaller ones
        chosen.append(path)
        total += size
        if total >= max_bytes:
            break
    return chosen


def _load_files(paths: list[Path], text_column: str):
    import datasets

    suffixes = {p.suffix.lower() for p in paths}
    builders = {_BUILDER_BY_SUFFIX.get(s, "text" if s in _TEXT_SUFFIXES else None) for s in suffixes}
    if None in builders:
        bad = sorted(s for s in suffixes if s not in _TEXT_SUFFIXES and s not in _BUILDER_BY_SUFFIX)
        raise UsageError(
            f"--data: unsupported file type(s) {bad}; use text ({', '.join(sorted(_TEXT_SUFFIXES))}), "
            ".json/.jsonl, .csv, .parquet or a dataset saved with save_to_disk"
        )
    if len(builders) > 1:
        raise UsageError(f"--data: mixed file types {sorted(suffixes)}; pass files of one kind")
    builder = builders.pop()
    files = [str(p) for p in paths]
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    # The files are local: datasets' "Downloading data" bar (it copies them into its cache) would
    # say otherwise, so the bars are off while the dataset is built, then restored.
    bars_were_on = not datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(builder, data_files={"train": files}, split="train", **kwargs)
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    if builder == "text":
        ds = ds.filter(lambda ex: bool(ex["text"].strip()))
    return _with_text_column(ds, text_column, "--data")


def _with_text_column(ds, text_column: str, where: str):
    if text_column not in ds.column_names:
        raise UsageError(f"{where}: the dataset has no {text_column!r} column (columns: {ds.column_names}); "
                         "pass --text-column")
    return ds.select_columns([text_column]).rename_column(text_column, "text") if text_column != "text" \
        else ds.select_columns(["text"])


def load_corpus(data: str | None = None, *, text_column: str = "text", max_bytes: int | None = None):
    """A ``datasets.Dataset`` with one ``text`` column (one document per row).

    Args:
        data: ``None`` for the standard-library corpus; ``packages:NAME,...`` for installed packages'
            Python sources; else a file, a directory of files, or a directory written by
            ``save_to_disk`` (a ``DatasetDict``'s ``train`` split is used).
        text_column: the column holding the text in the user's data.
        max_bytes: cap on the size of the standard-library or packages corpus (tiny settings).
    Raises:
        UsageError: missing path, unsupported files, no text column, or an empty dataset.
    """
    import datasets

    packages = package_names(data)
    if data is None:
        ds = _load_files(stdlib_source_files(max_bytes), "text")
        where = "default corpus"
    elif packages is not None:
        ds = _load_files(package_source_files(packages, max_bytes), "text")
        where = f"--data {data}"
    else:
        path = Path(data).expanduser()
        where = f"--data {data}"
        if not path.exists():
            raise UsageError(f"--data: {data} does not exist")
        if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists()
                              or (path / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise UsageError(f"--data: saved DatasetDict has no 'train' split (splits: {list(ds)})")
                ds = ds["train"]
            ds = _with_text_column(ds, text_column, "--data")
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
            if not files:
                raise UsageError(f"--data: directory {data} holds no files")
            ds = _load_files(files, text_column)
        else:
            ds = _load_files([path], text_column)
    ds = ds.filter(lambda ex: isinstance(ex["text"], str) and bool(ex["text"].strip()))
    if len(ds) == 0:
        raise UsageError(f"{where}: the dataset is empty (no non-blank text)")
    return ds
