"""MkDocs hook: publish the benchmark figures of ``benchmarks/results/`` under ``assets/`` in the site, so that the
benchmarks page shows the PNGs the scripts wrote without a second copy of them in ``docs/``."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def on_files(files: Files, config) -> Files:
    """Add every ``benchmarks/results/*.png`` as ``assets/NAME.png``."""
    for figure in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"assets/{figure.name}", abs_src_path=str(figure)))
    return files
