"""transformers' own common model tests, taken from the sdist of the installed transformers version on PyPI.

The sdist ships ``tests/test_modeling_common.py`` and ``tests/test_training_mixin.py`` but not the sub-packages that
``test_modeling_common`` imports two mixins from (``tests/generation``, ``tests/exporters``). Those two mixins are
replaced by empty classes: generation is covered by ``tests/test_generation.py`` instead, and export by
``tests/test_compile.py``. Nothing of transformers' is stored in this repository: the files are fetched with
``pip download`` on first use and cached outside the checkout.

``HF_MHC_TRANSFORMERS_TESTS`` overrides the cache folder (default ``~/.cache/hf-mhc``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import transformers

PACKAGE = "transformers_tests"
# Sub-modules that test_modeling_common imports but the sdist lacks, with the stand-in each gets.
STAND_INS = {
    "generation/test_utils.py": "class GenerationTesterMixin:\n"
    '    """Stand-in: mHC generation is tested in hf-mhc\'s tests/test_generation.py."""\n',
    "exporters/test_export.py": "class ExportTesterMixin:\n"
    '    """Stand-in: mHC models are traced with torch.compile in hf-mhc\'s tests/test_compile.py."""\n',
}


def cache_root() -> Path:
    return Path(os.environ.get("HF_MHC_TRANSFORMERS_TESTS", Path.home() / ".cache" / "hf-mhc"))


def transformers_tests_root(version: str = transformers.__version__) -> Path:
    """A folder holding the package ``transformers_tests`` (the sdist's ``tests/*.py``) for ``version``."""
    root = cache_root() / f"transformers-{version}-tests"
    if (root / PACKAGE / "__init__.py").is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as scratch:
        scratch = Path(scratch)
        download = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"transformers=={version}", "--dest", str(scratch)],
            capture_output=True, text=True, timeout=600,
        )
        if download.returncode != 0:
            raise RuntimeError(f"could not fetch the transformers {version} sdist from PyPI: {download.stderr[-2000:]}")
        (archive,) = scratch.glob("transformers-*.tar.gz")
        package = scratch / "staged" / PACKAGE
        package.mkdir(parents=True)
        prefix = f"{archive.name.removesuffix('.tar.gz')}/tests/"
        with tarfile.open(archive) as sdist:
            for member in sdist.getmembers():
                name = member.name.removeprefix(prefix)
                if member.name.startswith(prefix) and member.isfile() and "/" not in name and name.endswith(".py"):
                    (package / name).write_bytes(sdist.extractfile(member).read())
        if not (package / "test_modeling_common.py").is_file():
            raise RuntimeError(f"the transformers {version} sdist has no tests/test_modeling_common.py")
        (package / "__init__.py").touch()
        for relative, text in STAND_INS.items():
            path = package / relative
            path.parent.mkdir(exist_ok=True)
            (path.parent / "__init__.py").touch()
            path.write_text(text)
        try:
            (scratch / "staged").rename(root)
        except OSError:  # another process finished first: keep its copy
            if not (root / PACKAGE / "__init__.py").is_file():
                raise
        shutil.rmtree(scratch / "staged", ignore_errors=True)
    return root


def import_transformers_tests():
    """Put the cached sdist tests on ``sys.path``; return ``(test_modeling_common, test_training_mixin)``."""
    root = str(transformers_tests_root())
    if root not in sys.path:
        sys.path.insert(0, root)
    from transformers_tests import test_modeling_common, test_training_mixin

    return test_modeling_common, test_training_mixin
