"""Every code block of README.md and of docs/ runs as pasted.

Each document's blocks run in order, in a scratch copy of the repository root of their own (``../shared`` beside it
when present, ``examples/`` and ``.venv`` linked in), so that a later block can use a folder an earlier one saved:
each ``python`` block as its own script, each ``bash`` block with ``bash -e``, the virtual environment's scripts
(``hf-mhc``) first on ``PATH``. A block that cannot run here is marked, on the line before its fence, with
``<!-- not run by the tests: REASON -->``; a script that takes command-line arguments says the ones the tests give it
there, ``<!-- the tests run it with arguments: ARGS -->``. ``text`` blocks (formulas, printed output) are not run.
The site itself is built by ``make docs`` (``mkdocs build --strict``), which ``make test`` runs before pytest.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ASSETS

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCUMENTS = (README, *sorted((REPO / "docs").rglob("*.md")))
README_MAX_LINES = 250
RUN = {"python": [sys.executable], "bash": ["bash", "-e"]}
NOT_RUN_LANGUAGES = {"text"}
NOT_RUN = re.compile(r"<!-- not run by the tests: (.+?) -->")
RUN_WITH = re.compile(r"<!-- the tests run it with arguments: (.+?) -->")
FENCE = re.compile(r"^```(\w*)\s*$")
LINKED_INTO_SCRATCH = ("examples",)
SNIPPET_TIMEOUT_S = 300


@dataclass(frozen=True)
class CodeBlock:
    """One fenced block: its document, the line of its opening fence (1-based), language, code, the reason it is
    not run (``None`` when it runs) and the command-line arguments the tests run it with."""

    document: Path
    line: int
    language: str
    code: str
    reason: str | None
    arguments: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.document.relative_to(REPO)}:{self.line}"


def code_blocks(document: Path) -> list[CodeBlock]:
    """Every fenced block of ``document``, in order."""
    lines = document.read_text(encoding="utf-8").splitlines()
    blocks, index = [], 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if fence:
            end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
            marker = NOT_RUN.search(lines[index - 1]) if index else None
            run_with = RUN_WITH.search(lines[index - 1]) if index else None
            blocks.append(CodeBlock(document, index + 1, fence.group(1), "\n".join(lines[index + 1 : end]) + "\n",
                                    marker and marker.group(1), tuple(shlex.split(run_with.group(1))) if run_with
                                    else ()))
            index = end
        index += 1
    return blocks


BLOCKS = [block for document in DOCUMENTS for block in code_blocks(document)]
RUNNABLE = [block for block in BLOCKS if block.language in RUN]


def test_every_block_says_its_language_and_why_it_is_not_run():
    assert len(RUNNABLE) >= 20
    unknown = [block.name for block in BLOCKS if block.language not in {*RUN, *NOT_RUN_LANGUAGES}]
    assert not unknown, f"fenced blocks need a language among python, bash, text: {unknown}"
    assert all(block.reason is None or len(block.reason) > 10 for block in BLOCKS)
    assert not [block.name for block in BLOCKS if block.language in NOT_RUN_LANGUAGES and block.reason]


def test_the_readme_is_a_landing_page_whose_links_lead_somewhere():
    """At most ``README_MAX_LINES`` lines, and every relative link names a file of the repository (``mkdocs build
    --strict`` checks the links inside docs/, not the README's)."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    targets = [target.split("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", text)
               if "://" not in target and not target.startswith("#")]
    assert len(targets) >= 10
    assert not [target for target in targets if not (REPO / target).is_file()]


@pytest.fixture(scope="module")
def scratch_roots(tmp_path_factory) -> dict[Path, Path]:
    """Per document, ``root/repo`` as the working directory, with ``root/shared`` linked to the real ``../shared``
    and ``repo/.venv`` to the running environment."""
    roots = {}
    for document in DOCUMENTS:
        root = tmp_path_factory.mktemp(document.stem)
        repo = root / "repo"
        repo.mkdir()
        if ASSETS.is_dir():
            (root / "shared").symlink_to(ASSETS.parent, target_is_directory=True)
        (repo / ".venv").symlink_to(sys.prefix, target_is_directory=True)
        for name in LINKED_INTO_SCRATCH:
            (repo / name).symlink_to(REPO / name, target_is_directory=True)
        roots[document] = repo
    return roots


@pytest.mark.skipif(not ASSETS.is_dir(), reason="the snippets use ../shared/assets")
@pytest.mark.parametrize("block", RUNNABLE, ids=[block.name for block in RUNNABLE])
def test_code_block_runs(block, scratch_roots):
    if block.reason is not None:
        pytest.skip(f"{block.name}: {block.reason}")
    workdir = scratch_roots[block.document]
    script = workdir / f"block_{block.document.stem}_{block.line}.{'py' if block.language == 'python' else 'sh'}"
    script.write_text(block.code, encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run([*RUN[block.language], script.name, *block.arguments], cwd=workdir, env=env,
                            capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)
    assert result.returncode == 0, f"{block.name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def markdown_table(document: Path, heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first table under ``heading`` in ``document``, header and rule left out."""
    lines = document.read_text(encoding="utf-8").splitlines()
    start = lines.index(heading)
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows or line.startswith("#"):
            break
    return rows[2:]


def test_the_family_tables_are_the_wiring_table():
    """The README's and ``docs/backbones.md``'s family tables list exactly ``BACKBONE_WIRINGS``, in its order, and
    call a family's wiring plain "pre-norm" (or "pre-norm: " and how) exactly when its entry is ``PRE_NORM``."""
    from hf_mhc.configuration_mhc import BACKBONE_WIRINGS, PRE_NORM

    for document, heading, family_of, wiring_column in (
            (README, "## Supported families", lambda cell: re.fullmatch(r".+ \(`(\w+)`\)", cell).group(1), 2),
            (REPO / "docs" / "backbones.md", "## Supported families", lambda cell: cell.strip("`"), 2)):
        rows = markdown_table(document, heading)
        assert [family_of(row[0]) for row in rows] == list(BACKBONE_WIRINGS), document.name
        plain = {family_of(row[0]) for row in rows if re.match(r"pre-norm(:|$)", row[wiring_column])}
        assert plain == {family for family, wiring in BACKBONE_WIRINGS.items() if wiring == PRE_NORM}, document.name


def test_the_tolerance_table_of_the_docs_is_the_tests_table():
    """``docs/development.md`` quotes ``TOLERANCES`` of ``tests/reference_check.py``, the one table of the op tests:
    every dtype, forward and backward, the same numbers."""
    import torch
    from reference_check import TOLERANCES

    rows = markdown_table(REPO / "docs" / "development.md", "### Tolerances")
    quoted = {getattr(torch, row[0].split()[0]): (float(row[1]), float(row[2])) for row in rows}
    assert quoted == {dtype: (tolerance.forward, tolerance.backward) for dtype, tolerance in TOLERANCES.items()}


def test_the_readme_says_how_to_install_and_its_quickstart_takes_any_model():
    """A ``pip install -e .`` line, and a Python quickstart that takes the model (a Hub id or a folder) on its command
    line: ``../shared`` is only what the tests (offline) give it."""
    text = README.read_text(encoding="utf-8")
    assert re.search(r"^pip install -e \. ", text, re.M)
    quickstart = next(block for block in BLOCKS if block.document == README and block.language == "python")
    assert "sys.argv[1]" in quickstart.code and "../shared" not in quickstart.code
    assert quickstart.reason is None and quickstart.arguments == ("../shared/assets/stories260K",)
