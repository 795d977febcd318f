"""What the example scripts share (``examples/example_utils.py``: options, text data, model loading) and the
quickstart's own checks; each script's runs are tested in test_finetune_example.py, test_pipeline_finetune.py,
test_distributed.py and test_entry_points.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REJECTED_CONFIGS, import_script, tiny_backbone_config
from transformers import LlamaConfig, LlamaForCausalLM

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


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


@pytest.fixture(scope="module")
def quickstart():
    return import_script(EXAMPLES / "quickstart.py")


@pytest.mark.parametrize(
    ("config", "message"),
    REJECTED_CONFIGS,
)
def test_quickstart_refuses_a_config_transformers_rejects_in_one_line(quickstart, config, message, byte_tokenizer,
                                                                      tmp_path, capsys):
    model = tmp_path / "model"
    LlamaForCausalLM(tiny_backbone_config("llama", vocab_size=len(byte_tokenizer))).save_pretrained(model)
    byte_tokenizer.save_pretrained(model)
    config_file = model / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **config}))
    with pytest.raises(SystemExit) as exit_info:
        quickstart.main(["--model", str(model), "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    last = error.strip().splitlines()[-1]
    assert f": error: cannot load --model {model}: " in last and message in last


def test_quickstart_allows_the_float32_rounding_of_large_logits(quickstart, byte_tokenizer, tmp_path, capsys,
                                                                  monkeypatch):
    """A Llama whose logits reach about 2,000: the upcycled model's float32 rounding (a few 1e-7 of them) is far
    above an absolute 1e-4 and far below the converter's scale-aware tolerance."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(byte_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=byte_tokenizer.eos_token_id, bos_token_id=None, pad_token_id=None)
    source = LlamaForCausalLM(config)
    with torch.no_grad():
        source.lm_head.weight.mul_(3000.0)
    source.save_pretrained(tmp_path / "model")
    byte_tokenizer.save_pretrained(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    quickstart.main(["--model", str(tmp_path / "model"), "--steps", "1", "--output-dir", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if "max |logit difference| vs source" in line)
    difference = float(line.split("vs source = ")[1].split()[0])
    tolerance = float(line.split("(tolerance ")[1].split(")")[0])
    assert 1e-4 < difference < tolerance / 10, line
    assert (tmp_path / "out" / "model.safetensors").is_file()


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
