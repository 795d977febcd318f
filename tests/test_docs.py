"""Every Python snippet in the README runs as pasted: each block as its own script, in order, from a scratch copy of
the repository root (``../shared`` beside it when present), so that a later block can use a folder an earlier one
saved. A block that cannot run here is marked in the README with the reason, on the line before its fence:
``<!-- not run by the tests: REASON -->``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ASSETS

README = Path(__file__).resolve().parents[1] / "README.md"
NOT_RUN = re.compile(r"<!-- not run by the tests: (.+?) -->")
SNIPPET_TIMEOUT_S = 300


def python_snippets() -> list[tuple[int, str, str | None]]:
    """``(line, code, reason not run or None)`` of every ```` ```python ```` block, in README order."""
    lines = README.read_text(encoding="utf-8").splitlines()
    snippets, index = [], 0
    while index < len(lines):
        if lines[index].strip() == "```python":
            start = index
            end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
            marker = NOT_RUN.search(lines[start - 1]) if start else None
            snippets.append((start + 1, "\n".join(lines[start + 1 : end]) + "\n", marker and marker.group(1)))
            index = end
        index += 1
    return snippets


SNIPPETS = python_snippets()


def test_every_snippet_that_is_not_run_says_why():
    assert len(SNIPPETS) >= 5
    assert all(reason is None or len(reason) > 10 for _, _, reason in SNIPPETS)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """``root/repo`` as the working directory, with ``root/shared`` linked to the real ``../shared``."""
    root = tmp_path_factory.mktemp("readme")
    (root / "repo").mkdir()
    if ASSETS.is_dir():
        (root / "shared").symlink_to(ASSETS.parent, target_is_directory=True)
    return root / "repo"


@pytest.mark.skipif(not ASSETS.is_dir(), reason="the README snippets use ../shared/assets")
@pytest.mark.parametrize("line, code, reason", SNIPPETS, ids=[f"line{line}" for line, _, _ in SNIPPETS])
def test_readme_snippet_runs(line, code, reason, workdir):
    if reason is not None:
        pytest.skip(f"README line {line}: {reason}")
    script = workdir / f"snippet_line{line}.py"
    script.write_text(code, encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, script.name], cwd=workdir, env=env, capture_output=True, text=True,
                            timeout=SNIPPET_TIMEOUT_S)
    assert result.returncode == 0, f"README snippet at line {line} failed:\n{result.stderr[-4000:]}"
