"""examples/finetune.py: runs end to end (directly and through ``accelerate launch``), and rejects bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import (
    BAD_TRAINING_OPTIONS,
    JANEAUSTEN,
    REJECTED_CONFIGS,
    STORIES260K,
    assert_logits_close,
    assert_same_weights,
    import_script,
    tiny_backbone_config,
)
from peft import AutoPeftModelForCausalLM
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedTokenizerFast

import hf_mhc
from hf_mhc.conversion import is_hc_parameter
from hf_mhc.model_card import is_hf_mhc_card

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
    assert set(configs) == {"single_process", "multi_gpu_ddp", "fsdp2", "deepspeed_zero3"}
    assert configs["single_process"].distributed_type == "NO"
    assert configs["multi_gpu_ddp"].distributed_type == "MULTI_GPU"
    fsdp = configs["fsdp2"]
    assert fsdp.distributed_type == "FSDP" and fsdp.fsdp_config["fsdp_version"] == 2
    assert fsdp.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == hf_mhc.MHCDecoderLayer.__name__
    zero3 = configs["deepspeed_zero3"]  # run on two CPU ranks by tests/test_deepspeed.py
    assert zero3.distributed_type == "DEEPSPEED" and zero3.deepspeed_config["zero_stage"] == 3
    assert zero3.deepspeed_config["zero3_save_16bit_model"] and zero3.mixed_precision == "bf16"


@pytest.fixture(scope="module")
def example():
    return import_script(EXAMPLE)


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
    assert "--model: no such folder: " in usage_error(example, ["--model", str(tmp_path / "missing")], capsys)
    assert "--model: no such folder: ./missing/model" in usage_error(example, ["--model", "./missing/model"], capsys)
    assert "hc_mult must be an integer from 1 to 8" in usage_error(
        example, ["--model", str(tiny_llama_dir), "--upcycle", "--hc-mult", "9"], capsys
    )
    assert "--steps must be >= 1" in usage_error(example, ["--model", str(tiny_llama_dir), "--steps", "0"], capsys)
    upcycle = ["--model", str(tiny_llama_dir), "--upcycle"]
    assert "no file matches" in usage_error(example, [*upcycle, "--dataset", str(tmp_path / "none/*.txt")], capsys)
    message = usage_error(
        example, [*upcycle, "--dataset", str(text_files / "*.txt"), "--text-column", "body"], capsys
    )
    assert "no column 'body'" in message and "text" in message
    mhc_dir = tmp_path / "mhc"
    hf_mhc.upcycle(LlamaForCausalLM(tiny_backbone_config("llama"))).save_pretrained(mhc_dir)
    assert "already an mHC checkpoint" in usage_error(example, ["--model", str(mhc_dir), "--upcycle"], capsys)
    assert "--merge-lora needs --lora" in usage_error(example, [*upcycle, "--merge-lora"], capsys)


@pytest.mark.parametrize(("option", "value", "message"), BAD_TRAINING_OPTIONS)
def test_a_bad_training_option_is_refused_before_anything_is_loaded(
    example, option, value, message, tiny_llama_dir, text_files, tmp_path, capsys, datasets_cache
):
    """One line, status 2, nothing written: a block of one token trains on nothing, and the rest would fail (or train
    wrongly) only after loading the model. Checked when the options are parsed, before any path (here a --model that
    does not exist)."""
    out = tmp_path / "out"
    argv = tiny_run(tiny_llama_dir, text_files / "*.txt", "--output-dir", str(out), option, value)
    assert usage_error(example, argv, capsys).endswith(f"error: argument {option}: {message}")
    assert not out.exists()
    missing_model = [*argv[:argv.index("--model") + 1], str(tmp_path / "missing"), *argv[argv.index("--model") + 2:]]
    assert usage_error(example, missing_model, capsys).endswith(f"error: argument {option}: {message}")


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


def tiny_run(tiny_llama_dir: Path, dataset: Path | str, *extra: str) -> list[str]:
    """A 2-step full fine-tuning of the tiny Llama upcycled to 2 streams, in seconds; ``extra`` arguments follow."""
    return [
        "--model", str(tiny_llama_dir), "--upcycle", "--hc-mult", "2", "--dataset", str(dataset),
        "--steps", "2", "--batch-size", "2", "--block-size", "16", "--eval-blocks", "0", "--max-train-blocks", "8",
        "--stability-every", "0", "--logging-steps", "1", *extra,
    ]


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets_cache")


def earlier_lora_run(folder: Path, tiny_llama_dir: Path) -> None:
    """What a `--lora --merge-lora` run on an upcycled model leaves in its output folder (adapter, merged/,
    upcycled_base/, a checkpoint), made directly, plus a file of the user's own."""
    from peft import get_peft_model

    from hf_mhc.peft import mhc_lora_config

    base = hf_mhc.upcycle(LlamaForCausalLM.from_pretrained(tiny_llama_dir), hc_mult=2)
    base.save_pretrained(folder / "upcycled_base")
    adapter = get_peft_model(base, mhc_lora_config(r=2))
    with torch.no_grad():
        for name, param in adapter.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)  # an adapter that changes the logits a lot
    adapter.save_pretrained(folder)
    adapter.save_pretrained(folder / "checkpoint-3")
    (folder / "checkpoint-3" / "trainer_state.json").write_text("{}")
    adapter.merge_and_unload().save_pretrained(folder / "merged")
    (folder / "notes.txt").write_text("the user's own notes")


def test_a_non_empty_output_dir_needs_overwrite_which_replaces_only_the_earlier_run(
    example, tiny_llama_dir, text_files, tmp_path, capsys, datasets_cache
):
    out = tmp_path / "out"
    earlier_lora_run(out, tiny_llama_dir)
    capsys.readouterr()
    assert "is not empty: pass --overwrite" in usage_error(
        example, tiny_run(tiny_llama_dir, text_files / "*.txt", "--output-dir", str(out)), capsys
    )
    assert (out / "adapter_config.json").is_file()  # refused before anything was written

    # The earlier adapter folder is no model to train on, and neither is a model with an adapter beside it, which
    # transformers would silently apply on load (and then fail to save: "PEFT >= 0.22.0").
    assert "is a PEFT adapter, not a model" in usage_error(example, ["--model", str(out)], capsys)
    with_adapter = tmp_path / "with_adapter"
    shutil.copytree(out / "merged", with_adapter)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(out / name, with_adapter / name)
    assert "holds a PEFT adapter (adapter_config.json) beside the model" in usage_error(
        example, ["--model", str(with_adapter)], capsys
    )

    assert example.main(tiny_run(tiny_llama_dir, text_files / "*.txt", "--output-dir", str(out), "--overwrite")) == 0
    printed = capsys.readouterr().out
    assert "--overwrite: deleted the earlier run's" in printed and "kept 1 other file(s): notes.txt" in printed
    assert (out / "notes.txt").read_text() == "the user's own notes"
    for stale in ("adapter_config.json", "adapter_model.safetensors", "merged", "upcycled_base", "checkpoint-3"):
        assert not (out / stale).exists(), stale
    assert is_hf_mhc_card((out / "README.md").read_text())  # PEFT's card gone, the trained model's own in its place
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-2"]  # the last step is saved too
    # The saved model is the trained one alone: no stale adapter applied on load.
    trained = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not getattr(trained, "_hf_peft_config_loaded", False)
    last_checkpoint = AutoModelForCausalLM.from_pretrained(out / "checkpoint-2").eval()
    ids = torch.randint(3, trained.config.get_text_config().vocab_size, (1, 12))
    assert_same_weights(trained, last_checkpoint)
    with torch.no_grad():
        assert_logits_close(trained(ids).logits, last_checkpoint(ids).logits)


def test_paths_data_and_integrations_are_checked_before_training(
    example, tiny_llama_dir, text_files, tmp_path, capsys, datasets_cache, monkeypatch
):
    run = partial(tiny_run, tiny_llama_dir, text_files / "*.txt")
    mhc_dir = tmp_path / "mhc"
    hf_mhc.upcycle(LlamaForCausalLM.from_pretrained(tiny_llama_dir), hc_mult=2).save_pretrained(mhc_dir)
    capsys.readouterr()
    assert "--output-dir is the --model folder" in usage_error(
        example, ["--model", str(mhc_dir), "--lora", "--output-dir", str(mhc_dir) + "/"], capsys
    )
    (tmp_path / "file.txt").write_text("x")
    assert "is a file" in usage_error(example, run("--output-dir", str(tmp_path / "file.txt" / "out")), capsys)
    assert "empty path" in usage_error(example, run("--output-dir", ""), capsys)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("x")
    assert "not the output of an earlier run" in usage_error(
        example, run("--output-dir", str(mine), "--overwrite"), capsys
    )
    assert (mine / "thesis.tex").is_file()
    assert "choose one" in usage_error(example, run("--resume", "--overwrite"), capsys)
    assert "no checkpoint-* in --output-dir" in usage_error(
        example, run("--output-dir", str(tmp_path / "new"), "--resume"), capsys
    )

    data = tmp_path / "data"
    data.mkdir()
    (data / "empty.txt").write_text("")
    (data / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
    (data / "numbers.jsonl").write_text('{"text": 1}\n{"text": 2}\n')
    (data / "lists.jsonl").write_text('{"text": ["a", "b"]}\n')
    (data / "no_text.jsonl").write_text('{"text": ""}\n{"text": null}\n')
    (data / "spaces.jsonl").write_text('{"text": "   "}\n')
    (data / "no_texts").mkdir()
    (data / "no_texts" / "README").write_text("x")
    out = ["--output-dir", str(tmp_path / "out")]
    cases = {
        "empty.txt": "empty file",
        "broken.jsonl": "invalid JSON, line 2",
        "numbers.jsonl": "holds Value('int64'), not text",
        "lists.jsonl": "not text",
        "no_text.jsonl": "no text to train on (every 'text' is empty or null)",
        "spaces.jsonl": "the dataset gives 0 blocks of 16 tokens: add text or lower --block-size",
        "nothing*.txt": "no file matches",
        "missing.txt": "no such file or folder",
        "no_texts": "files in this folder",
    }
    for name, expected in cases.items():
        message = usage_error(example, tiny_run(tiny_llama_dir, data / name, *out), capsys)
        assert expected in message, (name, message)

    from transformers.integrations import integration_utils

    monkeypatch.setattr(integration_utils, "get_available_reporting_integrations", lambda: [])
    assert "tensorboard is not installed (pip install tensorboard)" in usage_error(
        example, run(*out, "--report-to", "tensorboard"), capsys
    )
    assert "unknown integration" in usage_error(example, run(*out, "--report-to", "tensorbored"), capsys)
    assert not (tmp_path / "out").exists()  # nothing was trained or written


def test_a_crash_keeps_the_checkpoints_and_resume_continues_from_the_last(
    example, tiny_llama_dir, text_files, tmp_path, capsys, datasets_cache, monkeypatch
):
    from transformers import Trainer

    lora = tiny_run(
        tiny_llama_dir, text_files / "*.txt", "--lora", "--lora-r", "2", "--steps", "3", "--save-steps", "1"
    )
    steps, crash_at = [], [3]
    training_step = Trainer.training_step

    def record_or_crash(self, *args, **kwargs):
        steps.append(self.state.global_step + 1)
        if steps[-1] in crash_at:
            raise RuntimeError("simulated crash")
        return training_step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "training_step", record_or_crash)
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        example.main([*lora, "--output-dir", str(crashed)])
    assert sorted(path.name for path in crashed.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]

    wrong_streams = [*lora[:lora.index("--hc-mult") + 1], "3", *lora[lora.index("--hc-mult") + 2:]]
    assert "pass the --model and --hc-mult of that run" in usage_error(
        example, [*wrong_streams, "--output-dir", str(crashed), "--resume"], capsys
    )
    steps.clear()
    crash_at.clear()
    assert example.main([*lora, "--output-dir", str(crashed), "--resume"]) == 0
    assert steps == [3]  # only the lost step ran again
    assert f"resuming from {crashed / 'checkpoint-2'}" in capsys.readouterr().out
    straight = tmp_path / "straight"
    assert example.main([*lora, "--output-dir", str(straight)]) == 0

    def losses(folder: Path) -> list[tuple[int, float]]:
        history = json.loads((folder / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]
        return [(entry["step"], float(entry["loss"])) for entry in history if "loss" in entry]

    resumed, expected = losses(crashed), losses(straight)
    assert [step for step, _ in resumed] == [step for step, _ in expected] == [1, 2, 3]
    # Step 3's loss is a forward pass of the weights restored from checkpoint-2, on the batch the sampler resumed at.
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in expected], rel=1e-5)
    # The adapter names the upcycled base saved beside it (absolute), so it loads from any working directory.
    config = json.loads((crashed / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((crashed / "upcycled_base").absolute())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    adapter = AutoPeftModelForCausalLM.from_pretrained(crashed).eval()
    reference = AutoPeftModelForCausalLM.from_pretrained(straight).eval()
    ids = torch.randint(3, adapter.config.get_text_config().vocab_size, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(adapter(input_ids=ids).logits, reference(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-5)


class SimulatedKill(BaseException):
    """Stands for the process being killed: nothing after it runs (an exception handler would not either)."""


def test_resume_skips_a_checkpoint_whose_save_was_cut_short(
    example, tiny_llama_dir, text_files, tmp_path, capsys, datasets_cache, monkeypatch
):
    from transformers import Trainer

    run = tiny_run(tiny_llama_dir, text_files / "*.txt", "--steps", "3", "--save-steps", "1", "--save-total-limit", "2")
    out = tmp_path / "out"
    save_optimizer_and_scheduler = Trainer._save_optimizer_and_scheduler

    def killed_in_the_second_save(self, output_dir):  # Trainer has written checkpoint-2's model, nothing more
        if self.state.global_step == 2:
            raise SimulatedKill
        return save_optimizer_and_scheduler(self, output_dir)

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_save_optimizer_and_scheduler", killed_in_the_second_save)
        with pytest.raises(SimulatedKill):
            example.main([*run, "--output-dir", str(out)])
    assert (out / "checkpoint-2" / "model.safetensors").is_file()
    assert not (out / "checkpoint-2" / "trainer_state.json").exists()
    killed_save = sorted(path.name for path in (out / "checkpoint-2").iterdir())
    capsys.readouterr()
    assert (f"--resume {out / 'checkpoint-2'}: incomplete checkpoint (trainer_state.json is missing), not one to "
            "continue from") in usage_error(example, [*run, "--output-dir", str(out), "--resume",
                                                      str(out / "checkpoint-2")], capsys)

    steps = []
    training_step = Trainer.training_step

    def record(self, *args, **kwargs):
        steps.append(self.state.global_step + 1)
        return training_step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "training_step", record)
    # Trainer would save step 2 into the incomplete checkpoint-2: the same command goes on, with checkpoint-2 set aside
    # (renamed, not deleted; not to a checkpoint-* name, which the --save-total-limit 2 rotation would delete)
    assert example.main([*run, "--output-dir", str(out), "--resume"]) == 0
    printed = capsys.readouterr().out
    (aside,) = [path for path in out.iterdir() if path.name.startswith("incomplete-checkpoint-2.")]
    assert (f"--resume: set aside the incomplete checkpoint-2 (trainer_state.json is missing) as {aside.name}, so "
            "that this run can save checkpoint-2 again; nothing of it is deleted\n") in printed, printed
    assert (f"resuming from {out / 'checkpoint-1'}; skipped: checkpoint-2 (incomplete: trainer_state.json is "
            "missing)") in printed, printed
    assert steps == [2, 3]
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
    assert sorted(path.name for path in aside.iterdir()) == killed_save  # as the killed save left it
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]


def test_resume_refuses_a_damaged_checkpoint_or_one_not_of_trainer(
    example, tiny_llama_dir, text_files, tmp_path, capsys, datasets_cache
):
    run = tiny_run(tiny_llama_dir, text_files / "*.txt", "--steps", "1", "--save-steps", "1")
    out = tmp_path / "out"
    assert example.main([*run, "--output-dir", str(out)]) == 0
    damages = {
        "optimizer.pt": "optimizer.pt is damaged or cut short (not a complete torch archive)",
        "scheduler.pt": "no scheduler state (scheduler.pt) in it: not a whole Trainer checkpoint",
        "model.safetensors": "model.safetensors is damaged or cut short (Error while deserializing header",
    }
    for damage, message in damages.items():
        damaged = tmp_path / f"damaged_{damage}"
        shutil.copytree(out, damaged)
        path = damaged / "checkpoint-1" / damage
        if damage == "scheduler.pt":
            path.unlink()
        else:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        capsys.readouterr()
        assert f"--resume {damaged / 'checkpoint-1'}: {message}" in usage_error(
            example, [*run, "--output-dir", str(damaged), "--resume"], capsys
        )

    for state in ({}, {"global_step": 1, "log_history": 5}, {"global_step": "x"}):  # JSON, but not Trainer's fields
        foreign = tmp_path / f"foreign_{len(state)}_{'x' in str(state)}"
        shutil.copytree(out, foreign)
        (foreign / "checkpoint-1" / "trainer_state.json").write_text(json.dumps(state))
        capsys.readouterr()
        assert f"--resume {foreign / 'checkpoint-1'}: trainer_state.json is not a Trainer state" in usage_error(
            example, [*run, "--output-dir", str(foreign), "--resume", str(foreign / "checkpoint-1")], capsys)
    later = tmp_path / "later"  # resuming an older checkpoint would make Trainer save over a newer, complete one
    shutil.copytree(out, later)
    shutil.copytree(later / "checkpoint-1", later / "checkpoint-5")
    capsys.readouterr()
    before = sorted(str(path.relative_to(later)) for path in later.rglob("*"))
    assert (f"--resume {later / 'checkpoint-1'} continues at step 1 and would save checkpoint-5 again, which "
            "--output-dir already holds: move it away first (nothing is replaced)") in usage_error(
        example, [*run, "--output-dir", str(later), "--resume", str(later / "checkpoint-1")], capsys)
    assert sorted(str(path.relative_to(later)) for path in later.rglob("*")) == before  # nothing renamed or written

    # a checkpoint of examples/pipeline_finetune.py has a trainer_state.json of its own
    mhc_dir = tmp_path / "mhc"
    hf_mhc.upcycle(LlamaForCausalLM.from_pretrained(tiny_llama_dir), hc_mult=2).save_pretrained(mhc_dir)
    PreTrainedTokenizerFast.from_pretrained(tiny_llama_dir).save_pretrained(mhc_dir)
    pipeline = tmp_path / "pipeline"
    pipeline_run = ["--model", str(mhc_dir), "--dataset", str(text_files / "part1.txt"), "--steps", "2",
                    "--save-every", "1", "--batch-size", "2", "--block-size", "16"]
    assert import_script(REPO / "examples" / "pipeline_finetune.py").main([*pipeline_run, "--output-dir",
                                                                           str(pipeline)]) == 0
    capsys.readouterr()
    message = usage_error(example, ["--model", str(mhc_dir), "--dataset", str(text_files / "part1.txt"),
                                    "--output-dir", str(pipeline), "--resume", str(pipeline / "checkpoint-1")], capsys)
    assert (f"--resume {pipeline / 'checkpoint-1'}: trainer_state.json is not a Trainer state (TrainerState.__init__() "
            "got an unexpected keyword argument 'options')") in message


def test_empty_texts_are_skipped(example, tiny_llama_dir, tmp_path, datasets_cache):
    """A thousand empty texts (a whole tokenisation batch of them) before the real ones."""
    texts = [""] * 1000 + pydoc_text(20_000).split("\n\n")
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    assert example.main(tiny_run(tiny_llama_dir, tmp_path / "texts.jsonl", "--output-dir", str(tmp_path / "out"))) == 0


@pytest.mark.parametrize(
    ("config", "message"),
    REJECTED_CONFIGS,
)
def test_a_config_transformers_rejects_is_a_one_line_error(example, config, message, tiny_llama_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    config_file = model / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **config}))
    error = usage_error(example, ["--model", str(model), "--upcycle"], capsys)
    assert f"cannot load --model {model}: " in error and message in error
