"""MkDocs hook: lay out the sources as they install, for mkdocstrings.

``kernels/`` and ``conversion/`` install as ``hf_mhc.kernels`` and ``hf_mhc.conversion`` (setuptools ``package-dir``
in ``pyproject.toml``), which griffe cannot follow on its own. When MkDocs loads this hook, before any page is
rendered, it builds ``build/docs-source/`` (ignored by git) as a tree of links in the installed layout; the
mkdocstrings handler reads the sources from there (``paths`` in ``mkdocs.yml``), statically, without importing them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_TREE = ROOT / "build" / "docs-source"


def package_dirs(pyproject: Path) -> dict[str, str]:
    """``{package: folder}`` from the ``[tool.setuptools.package-dir]`` table of ``pyproject``."""
    lines = pyproject.read_text(encoding="utf-8").splitlines()
    start = lines.index("[tool.setuptools.package-dir]") + 1
    mapping = {}
    for line in lines[start:]:
        if line.startswith("["):
            break
        if "=" in line:
            package, folder = (part.strip().strip('"') for part in line.split("#")[0].split("=", 1))
            mapping[package] = folder
    return mapping


def build_source_tree(root: Path, tree: Path) -> None:
    """Recreate ``tree``: each package of ``package_dirs`` at its dotted path, its entries linked to ``root``'s."""
    shutil.rmtree(tree, ignore_errors=True)
    for package, folder in sorted(package_dirs(root / "pyproject.toml").items()):
        target = tree.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for entry in (root / folder).iterdir():
            if entry.name != "__pycache__" and not target.joinpath(entry.name).exists():
                target.joinpath(entry.name).symlink_to(entry)


build_source_tree(ROOT, SOURCE_TREE)
