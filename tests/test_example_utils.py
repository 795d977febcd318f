"""``examples/example_utils.py``, what the example scripts share: text blocks, the --seed option, the all-or-nothing
checkpoint save, clearing an earlier output."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import EXAMPLES, import_script


@pytest.fixture(scope="module")
def example_utils():
    return import_script(EXAMPLES / "example_utils.py")


@pytest.fixture(scope="module")
def byte_tokenizer():
    return import_script(EXAMPLES / "fsdp2_finetune.py").byte_tokenizer()


def test_token_blocks_skip_empty_texts_and_read_only_what_they_need(example_utils, byte_tokenizer):
    def ids(text: str) -> list[int]:
        return byte_tokenizer(text, add_special_tokens=False)["input_ids"]

    eos = [byte_tokenizer.eos_token_id]
    texts = [""] * 1000 + [None, "abc", "", "defgh"]  # more empty texts than the tokenizer takes at once
    joined = ids("abc") + eos + ids("defgh") + eos  # 10 ids: 3 blocks of 3, the last id dropped
    assert example_utils.token_blocks(texts, byte_tokenizer, 3) == [joined[0:3], joined[3:6], joined[6:9]]
    assert example_utils.token_blocks(["", None], byte_tokenizer, 3) == []

    read = []

    def paragraphs():
        for index in range(10_000):
            read.append(index)
            yield "x" * 9

    blocks = example_utils.token_blocks(paragraphs(), byte_tokenizer, 5, max_blocks=4)
    assert blocks == [ids("x" * 5), ids("x" * 4) + eos] * 2
    assert len(read) < 10_000


@pytest.mark.parametrize("script", ["finetune", "pipeline_finetune", "fsdp2_finetune", "quickstart"])
@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_every_example_refuses_a_seed_out_of_range_when_it_parses_it(script, seed, tmp_path, capsys):
    """numpy's seeding (transformers.set_seed) takes 0 to 2**32 - 1: anything else is an argparse error, before any
    other check (the --model here does not exist)."""
    argv = ["--model", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "out"), "--seed", seed]
    with pytest.raises(SystemExit) as exit_info:
        import_script(EXAMPLES / f"{script}.py").main(argv)
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith(f"error: argument --seed: must be an integer from 0 to 4294967295 (2**32 - 1), got {seed}")


def test_the_shared_checkpoint_save_is_all_or_nothing(example_utils, tmp_path):
    folder = tmp_path / "checkpoint-1"
    with pytest.raises(OSError, match="disk full"), example_utils.atomic_folder(folder) as partial:
        (partial / "model.safetensors").write_bytes(b"x")
        raise OSError("disk full")
    assert list(tmp_path.iterdir()) == []
    with example_utils.atomic_folder(folder) as partial:
        assert partial.parent == tmp_path and partial.name.startswith(".checkpoint-1.partial-")
        (partial / "trainer_state.json").write_text("{}")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint-1"]
    assert (folder / "trainer_state.json").read_text() == "{}"
    with pytest.raises(FileExistsError), example_utils.atomic_folder(folder):
        pass
    shutil.rmtree(folder)


def test_clear_earlier_output_deletes_only_what_is_named_and_folders_it_empties(example_utils, tmp_path):
    """Files the predicate accepts go, there and in the subfolders accepted (nested ones included, relative paths);
    a subfolder emptied so goes too; the rest stays and is listed as kept."""
    for name in ("config.json", "notes.txt", "merged/model.safetensors", "merged/deeper/model.safetensors",
                 "checkpoint-5/optimizer.pt", "trainer/log.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    seen = []

    def cleared_subfolder(relative: Path) -> bool:
        seen.append(relative)
        return relative.parts[0] in ("merged", "checkpoint-5")

    removed, kept = example_utils.clear_earlier_output(tmp_path, lambda entry: entry.suffix != ".txt",
                                                       cleared_subfolder)
    assert removed == ["checkpoint-5/", "config.json", "merged/"]
    assert kept == ["notes.txt", "trainer/"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt", "trainer"]
    assert Path("merged", "deeper") in seen and Path("trainer") in seen
