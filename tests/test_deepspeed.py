"""DeepSpeed ZeRO-2 / ZeRO-3 with mHC models (``Trainer``, ``accelerate launch``), on two gloo CPU ranks against one
process.

DeepSpeed is an optional extra (``pip install 'hf-mhc[deepspeed]'``), and transformers changes what it does when it can
import DeepSpeed, so this test process never imports it: ``make test`` installs it into ``.venv/deepspeed-site`` (or
``HF_MHC_DEEPSPEED_SITE``), which only the rank processes started here get on their ``PYTHONPATH``. Without it the
tests that need it skip with one line. One launch of ``distributed_workers/deepspeed_worker.py`` runs every ``Trainer``
scenario (see its docstring); one ``accelerate launch`` runs ``examples/finetune.py`` with
``examples/accelerate/deepspeed_zero3.yaml``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    STORIES260K,
    WORKERS,
    assert_ordinary_mhc_folder,
    free_port,
    remote_code_logits,
    tiny_backbone_config,
    torchrun,
)
from transformers import AutoModelForCausalLM

import hf_mhc
from hf_mhc import MHCForCausalLM
from hf_mhc.conversion import is_hc_parameter

REPO = Path(__file__).resolve().parents[1]
DEEPSPEED_SITE = Path(os.environ.get("HF_MHC_DEEPSPEED_SITE", REPO / ".venv" / "deepspeed-site"))
DEEPSPEED_ZERO3_YAML = REPO / "examples" / "accelerate" / "deepspeed_zero3.yaml"
LAUNCH_TIMEOUT_S = 600
# The same model and code on one rank: logits of a gathered ZeRO-3 model and of a plain load (measured: bit-equal),
# compared as a reloaded model's are, to 1e-4 of their scale.
LOGIT_RTOL = 1e-4


def deepspeed_site() -> str | None:
    """The ``PYTHONPATH`` entry from which the rank processes import DeepSpeed: ``DEEPSPEED_SITE``, or ``""`` where it
    is installed in this environment (``hf-mhc[deepspeed]``); ``None`` where it is nowhere."""
    if (DEEPSPEED_SITE / "deepspeed" / "__init__.py").is_file():
        return str(DEEPSPEED_SITE)
    return "" if importlib.util.find_spec("deepspeed") is not None else None


SKIP_REASON = "DeepSpeed is not installed: pip install 'hf-mhc[deepspeed]' (make test puts it in .venv/deepspeed-site)"
needs_deepspeed = pytest.mark.skipif(deepspeed_site() is None, reason=SKIP_REASON)


def deepspeed_environment() -> dict[str, str]:
    site = deepspeed_site()
    path = os.pathsep.join(entry for entry in (site, os.environ.get("PYTHONPATH", "")) if entry)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[dict[str, dict], Path]:
    """One launch of ``deepspeed_worker.py``: each scenario's ``RESULT`` line by name, and its output folder."""
    if deepspeed_site() is None:
        pytest.skip(SKIP_REASON)
    folder = tmp_path_factory.mktemp("deepspeed")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", deepspeed_environment()["PYTHONPATH"])
        patch.setattr("conftest.LAUNCH_TIMEOUT_S", LAUNCH_TIMEOUT_S)  # the first run JIT-builds DeepSpeed's CPU op
        output = torchrun(WORKERS / "deepspeed_worker.py", str(folder), cwd=folder)
    lines = [json.loads(line.split("RESULT ", 1)[1]) for line in output.splitlines() if line.startswith("RESULT ")]
    return {line.pop("scenario"): line for line in lines}, folder


def test_deepspeed_stays_out_of_this_process():
    """transformers behaves differently where it can import DeepSpeed: only the ranks started here get it."""
    if deepspeed_site():
        assert importlib.util.find_spec("deepspeed") is None and "deepspeed" not in sys.modules


@needs_deepspeed
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_trainer_zero_stage_matches_one_process(launch, stage):
    """Gradients of the first step (before DeepSpeed's optimizer step) within ``FLOAT32_RTOL`` of each tensor's scale
    plus the gradient floor, parameters after three AdamW steps within what AdamW allows (``adamw_parameter_atol``),
    each rank on its own rows. The worker asserts both bounds; this reads what it measured."""
    result = launch[0][stage]
    assert result["rows_differ"] and result["steps"] == 3
    assert result["loaded_partitioned"] == (stage == "zero3")  # ZeRO-3 loads under zero.Init
    assert result["gradient_bound_used"] <= 1.0
    assert result["parameter_error"] <= result["parameter_atol"]
    assert result["dtypes"]["hc_parameters"] == ["torch.float32"] and result["dtypes"]["maps"] == ["torch.float32"]
    assert result["dtypes"]["hc_shapes_empty"] == [False]  # the hooks saw ZeRO-3's gathered parameters
    assert result["hc_master_dtypes"] == ["torch.float32"]


@needs_deepspeed
def test_zero3_from_pretrained_under_zero_init_gathers_to_the_plain_load(launch):
    result = launch[0]["zero_init_load"]
    assert result["partitioned"] and result["mismatched"] == []
    assert result["dtypes"] == {"backbone": ["torch.float32"], "hc": ["torch.float32"]}
    assert result["logit_error_of_scale"] <= LOGIT_RTOL


@needs_deepspeed
def test_upcycle_of_a_model_loaded_under_zero3_is_partitioned_and_equals_a_plain_upcycle(launch):
    """Was: ``size mismatch for model.embed_tokens.weight: copying a param with shape torch.Size([0])``."""
    result = launch[0]["upcycle_zero3"]
    assert result["source_partitioned"] and result["source_still_partitioned"]
    assert result["partitioned"] and result["mismatched"] == []
    assert result["dtypes"] == {"backbone": ["torch.float32"], "hc": ["torch.float32"]}
    assert math.isfinite(result["loss"])


@needs_deepspeed
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_bf16_casts_every_parameter_the_hc_ones_too(launch, stage):
    """DeepSpeed's ``bf16`` mode casts the whole module: the HC weights are bf16 in the forward (the maps are still
    float32, computed from bf16-rounded weights); its optimizer keeps float32 master weights and gradients."""
    result = launch[0][f"bf16_{stage}"]
    assert result["module_parameters"] == {"backbone": ["torch.bfloat16"], "hc": ["torch.bfloat16"]}
    assert result["dtypes"]["hc_parameters"] == ["torch.bfloat16"] and result["dtypes"]["maps"] == ["torch.float32"]
    assert result["master_parameters"] == ["torch.float32"] and result["hc_gradients"] == ["torch.float32"]
    assert math.isfinite(result["loss"])


@needs_deepspeed
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_torch_autocast_keeps_the_hc_parameters_float32(launch, stage):
    """DeepSpeed's ``torch_autocast`` mode instead keeps every parameter float32 and runs the forward under
    ``torch.autocast``: the projections compute in bf16, the HC maps in float32 from float32 weights."""
    result = launch[0][f"autocast_{stage}"]
    assert result["module_parameters"] == {"backbone": ["torch.float32"], "hc": ["torch.float32"]}
    assert result["dtypes"]["hc_parameters"] == ["torch.float32"] and result["dtypes"]["maps"] == ["torch.float32"]
    assert result["dtypes"]["backbone_outputs"] == ["torch.bfloat16"]
    assert math.isfinite(result["loss"])


def assert_saved_weights(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    """The loaded weights are the trained ones, bit for bit, HC float32."""
    parameters = dict(model.named_parameters())
    assert set(parameters) == set(expected), set(parameters) ^ set(expected)
    for name, tensor in expected.items():
        assert torch.equal(parameters[name], tensor), name
        assert parameters[name].dtype == torch.float32, name


def assert_loads_with_and_without_the_plugin(folder: Path, expected: dict[str, torch.Tensor], work: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(model) is MHCForCausalLM
    assert_saved_weights(model, expected)
    ids = torch.randint(3, model.config.get_text_config().vocab_size, (2, 9))
    with torch.no_grad():
        logits = model(ids).logits
    remote = remote_code_logits(folder, ids, work)  # a process where `import hf_mhc` fails
    assert (remote - logits).abs().max() <= LOGIT_RTOL * logits.abs().max()


@needs_deepspeed
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_save_model_writes_an_ordinary_mhc_folder(launch, stage, tmp_path):
    """ZeRO-2, and ZeRO-3 with ``stage3_gather_16bit_weights_on_model_save``: ``trainer.save_model`` writes an ordinary
    mHC folder holding the trained weights, which loads with and without the plugin."""
    _, folder = launch
    assert_ordinary_mhc_folder(folder / stage)
    assert_loads_with_and_without_the_plugin(folder / stage, torch.load(folder / f"{stage}_expected.pt"), tmp_path)


CONVERT = """
import sys
import hf_mhc  # noqa: F401
from deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM

checkpoint, output = sys.argv[1:]
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
model = load_state_dict_from_zero_checkpoint(model, checkpoint)
model.save_pretrained(output)
"""


@needs_deepspeed
def test_a_zero3_checkpoint_converts_with_zero_to_fp32(launch, tmp_path):
    """ZeRO-3 without ``stage3_gather_16bit_weights_on_model_save``: ``trainer.save_model`` writes DeepSpeed's
    partitioned checkpoint with its ``zero_to_fp32.py``. Its ``load_state_dict_from_zero_checkpoint`` gives the trained
    weights, saved as an ordinary mHC folder; the script itself writes ``pytorch_model.bin`` beside the checkpoint
    (its ``--safe_serialization`` refuses the tied embedding of stories260K: "Some tensors share memory")."""
    _, folder = launch
    checkpoint = folder / "upcycle_zero3"
    assert (checkpoint / "zero_to_fp32.py").is_file() and (checkpoint / "latest").is_file()
    assert not (checkpoint / "model.safetensors").exists()
    expected = torch.load(folder / "upcycle_zero3_expected.pt")
    environment = deepspeed_environment()
    converted = tmp_path / "converted"
    for command in ([sys.executable, "-c", CONVERT, str(checkpoint), str(converted)],
                    [sys.executable, str(checkpoint / "zero_to_fp32.py"), str(checkpoint), str(checkpoint)]):
        result = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    assert_ordinary_mhc_folder(converted)
    assert_loads_with_and_without_the_plugin(converted, expected, tmp_path)
    assert_saved_weights(AutoModelForCausalLM.from_pretrained(checkpoint), expected)  # pytorch_model.bin


@needs_deepspeed
def test_accelerate_launch_with_the_deepspeed_zero3_config(tmp_path):
    """``accelerate launch --config_file examples/accelerate/deepspeed_zero3.yaml examples/finetune.py --bf16`` on two
    CPU ranks: DeepSpeed ZeRO-3 trains (each rank on its own rows) and saves a gathered mHC folder, in bf16 (DeepSpeed's
    bf16 mode casts every parameter; loading upcasts the HC ones to float32)."""
    from pydoc_data.topics import topics

    text = tmp_path / "texts"
    text.mkdir()
    (text / "part.txt").write_text("\n\n".join(topics[key] for key in sorted(topics))[:40_000], encoding="utf-8")
    out = tmp_path / "out"
    model_args = [] if STORIES260K.is_dir() else ["--model", str(tiny_llama(tmp_path / "tiny")), "--upcycle"]
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(DEEPSPEED_ZERO3_YAML),
        "--num_processes", "2", "--main_process_port", str(free_port()), str(REPO / "examples" / "finetune.py"),
        *model_args, "--dataset", str(text / "*.txt"), "--bf16", "--steps", "2", "--logging-steps", "1",
        "--batch-size", "2", "--block-size", "32", "--eval-blocks", "4", "--max-train-blocks", "16",
        "--output-dir", str(out),
    ]
    result = subprocess.run(command, cwd=tmp_path, env={**deepspeed_environment(), "HF_DATASETS_CACHE": str(
        tmp_path / "datasets_cache")}, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "DeepSpeed" in output and "'epoch': '0.25'" in output, output[-3000:]  # 16 blocks, 2 ranks x 2 per step
    assert "held-out loss" in output and "saved the model" in output
    assert_ordinary_mhc_folder(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model) is MHCForCausalLM and str(model.config.dtype).endswith("bfloat16")
    assert {p.dtype for n, p in model.named_parameters() if is_hc_parameter(n)} == {torch.float32}


def tiny_llama(folder: Path) -> Path:
    """A residual 2-layer Llama with a byte-level tokenizer (stories260K's stand-in)."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["<unk>", "<s>", "</s>"]
    bpe.train_from_iterator(list(topics.values()), trainers.BpeTrainer(vocab_size=300, special_tokens=special))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(folder)
    LlamaForCausalLM(tiny_backbone_config("llama", vocab_size=len(tokenizer))).save_pretrained(folder)
    return folder


def test_upcycle_of_an_unpartitioned_model_takes_no_deepspeed_path():
    """Only a source whose parameters DeepSpeed partitioned is gathered and its result partitioned."""
    model = hf_mhc.upcycle(AutoModelForCausalLM.from_config(tiny_backbone_config("llama")))
    assert not any(hasattr(parameter, "ds_id") for parameter in model.parameters())
    assert "deepspeed" not in sys.modules
