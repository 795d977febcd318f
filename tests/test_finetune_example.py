"""examples/finetune.py: runs end to end (directly and through ``accelerate launch``), and rejects bad input."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import JANEAUSTEN, STORIES260K, tiny_backbone_config
from peft import AutoPeftModelForCausalLM
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedTokenizerFast

import hf_mhc
from hf_mhc.conversion import is_hc_parameter

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "finetune.py"
ACCELERATE_CONFIGS = REPO / "examples" / "accelerate"
RUN_TIMEOUT_S = 240


def pydoc_text(characters: int) -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))[:characters]


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A residual 2-layer Llama with a byte-level BPE tokenizer trained on pydoc_data (no assets, no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("tiny_llama")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        pydoc_text(200_000).split("\n\n"), trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(folder)
    LlamaForCausalLM(tiny_backbone_config("llama", vocab_size=len(tokenizer))).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def text_files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("texts")
    text = pydoc_text(60_000)
    (folder / "part1.txt").write_text(text[:30_000], encoding="utf-8")
    (folder / "part2.txt").write_text(text[30_000:], encoding="utf-8")
    return folder


def run(command: list[str], tmp_path: Path) -> str:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # tiny models: extra threads only contend for the shared cores
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets_cache"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    # Not from the repository root: its kernels/ folder would shadow Hugging Face's `kernels` package.
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{output[-6000:]}"
    return output


def test_lora_fine_tuning_of_an_upcycled_model_saves_an_adapter_with_the_hc_maps(tiny_llama_dir, text_files, tmp_path):
    out = tmp_path / "out"
    output = run(
        [
            sys.executable, str(EXAMPLE), "--model", str(tiny_llama_dir), "--upcycle", "--hc-mult", "2",
            "--dataset", str(text_files / "*.txt"), "--lora", "--lora-r", "4", "--merge-lora", "--steps", "4",
            "--logging-steps", "2", "--batch-size", "4", "--block-size", "32", "--eval-blocks", "4",
            "--output-dir", str(out),
        ],
        tmp_path,
    )
    assert "n = 2 streams" in output and "2 local file(s)" in output
    assert output.count("'mhc/composite_forward_gain'") == 3  # steps 0, 2 and 4
    assert "'loss'" in output and "held-out loss" in output and "mHC stability at the end" in output
    with safe_open(out / "adapter_model.safetensors", framework="pt") as adapter:
        keys = set(adapter.keys())
    assert any("lora_A" in key for key in keys)
    assert len({key for key in keys if is_hc_parameter(key)}) == 2 * 2 * 3 + 3  # every HC tensor of the model
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    assert type(merged) is hf_mhc.MHCForCausalLM and merged.config.hc_mult == 2
    # The adapter names the saved upcycled model as its base, so it loads on its own.
    adapter_model = AutoPeftModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(3, merged.config.get_text_config().vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(adapter_model(input_ids=ids).logits, merged(ids).logits, rtol=1e-5, atol=1e-5)


def test_accelerate_launch_with_the_single_process_config(tiny_llama_dir, text_files, tmp_path):
    model = STORIES260K if STORIES260K.is_dir() else tiny_llama_dir  # the real pretrained Llama when present
    model_args = ["--model", str(model), "--upcycle", "--dataset", str(text_files / "*.txt")]
    out = tmp_path / "out"
    output = run(
        [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(ACCELERATE_CONFIGS / "single_process.yaml"), str(EXAMPLE),
            *model_args, "--steps", "2", "--logging-steps", "1", "--stability-per-site", "--batch-size", "2",
            "--block-size", "32", "--eval-blocks", "0", "--output-dir", str(out),
        ],
        tmp_path,
    )
    assert "'mhc/layer_1/ffn/backward_gain_max'" in output and "'loss'" in output
    trained = AutoModelForCausalLM.from_pretrained(out)
    assert type(trained) is hf_mhc.MHCForCausalLM


def test_accelerate_configs_are_valid_and_wrap_the_mhc_decoder_layer():
    from accelerate.commands.config.config_args import load_config_from_file

    configs = {path.stem: load_config_from_file(str(path)) for path in ACCELERATE_CONFIGS.glob("*.yaml")}
    assert set(configs) == {"single_process", "multi_gpu_ddp", "fsdp2"}
    assert configs["single_process"].distributed_type == "NO"
    assert configs["multi_gpu_ddp"].distributed_type == "MULTI_GPU"
    fsdp = configs["fsdp2"]
    assert fsdp.distributed_type == "FSDP" and fsdp.fsdp_config["fsdp_version"] == 2
    assert fsdp.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == hf_mhc.MHCDecoderLayer.__name__


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("finetune_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def usage_error(example, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        example.main(argv)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert ": error: " in message
    return message


def test_bad_input_gets_a_one_line_error(example, tiny_llama_dir, text_files, tmp_path, capsys, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets_cache")
    assert "add --upcycle" in usage_error(example, ["--model", str(tiny_llama_dir)], capsys)
    assert "--hc-mult only applies" in usage_error(example, ["--model", str(tiny_llama_dir), "--hc-mult", "2"], capsys)
    assert "cannot load --model" in usage_error(example, ["--model", str(tmp_path / "missing")], capsys)
    assert "hc_mult must be an integer from 1 to 8" in usage_error(
        example, ["--model", str(tiny_llama_dir), "--upcycle", "--hc-mult", "9"], capsys
    )
    assert "--steps must be >= 1" in usage_error(example, ["--model", str(tiny_llama_dir), "--steps", "0"], capsys)
    upcycle = ["--model", str(tiny_llama_dir), "--upcycle"]
    assert "no such file" in usage_error(example, [*upcycle, "--dataset", str(tmp_path / "none/*.txt")], capsys)
    message = usage_error(
        example, [*upcycle, "--dataset", str(text_files / "*.txt"), "--text-column", "body"], capsys
    )
    assert "no column 'body'" in message and "text" in message
    mhc_dir = tmp_path / "mhc"
    hf_mhc.upcycle(LlamaForCausalLM(tiny_backbone_config("llama"))).save_pretrained(mhc_dir)
    assert "already an mHC checkpoint" in usage_error(example, ["--model", str(mhc_dir), "--upcycle"], capsys)
    assert "--merge-lora needs --lora" in usage_error(example, [*upcycle, "--merge-lora"], capsys)


def test_defaults_are_the_shared_assets_when_present_else_need_no_download(example, tmp_path, monkeypatch, capsys):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets_cache")
    if STORIES260K.is_dir():
        parser, args = example.parse_args([])
        assert args.model == str(STORIES260K) and args.upcycle
    else:
        assert "--model is required" in usage_error(example, [], capsys)
        parser, args = example.parse_args(["--model", "any"])
    texts, description = example.load_texts(parser, args)
    if JANEAUSTEN.is_dir():
        assert description.startswith("6 local file(s)") and len(texts) > 10_000
        assert any("truth universally acknowledged" in text for text in texts["text"][:20_000])
    else:
        assert description == "Python's pydoc_data help texts" and len(texts) > 1_000
