"""Quantized weights on load, as a CPU user reaches for them: ``from_pretrained(..., quantization_config=...)`` with
torchao's int8 weight-only (``TorchAoConfig(Int8WeightOnlyConfig())``) and quanto's int8 (``QuantoConfig(weights=
"int8")``), on a tiny Llama and the mHC model upcycled from it.

The quantizers replace the weights of the backbone's ``nn.Linear`` modules, the same ones in both models; the HC
modules (``attn_hc``, ``ffn_hc``, ``hc_head``) hold plain parameters, which stay unquantized and float32, also under
``dtype=torch.bfloat16`` (created float32, and listed in ``_keep_in_fp32_modules_strict``). Both models then hold
the same int8 weights and compute in float32, so the quantized mHC model decodes greedily what the quantized source
does (``assert_same_greedy_decoding``: logits to the converter's rule, tokens up to a near-tie).

transformers imports torchao when it loads any model once torchao can be imported, which logs warnings about
torchao's CUDA extensions and costs seconds in every process, so this test process never imports it: ``make test``
installs torchao and optimum-quanto into ``.venv/quant-site`` (or ``HF_MHC_QUANT_SITE``), which only the worker
processes started here get on their ``PYTHONPATH`` (``workers/quantized_weights.py``). Without them the tests skip
with one line; ``pip install 'hf-mhc[torchao,quant]'`` installs them for users.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_same_greedy_decoding, perturbed_source_model, token_ids
from transformers.utils import is_optimum_quanto_available, is_torchao_available

import hf_mhc
from hf_mhc.conversion import is_hc_parameter

REPO = Path(__file__).resolve().parents[1]
QUANT_SITE = Path(os.environ.get("HF_MHC_QUANT_SITE", REPO / ".venv" / "quant-site"))
WORKER = Path(__file__).parent / "workers" / "quantized_weights.py"
# Each method: the distribution it needs, its package folder, and transformers' check that this environment has it.
PACKAGES = {"torchao": ("torchao", "torchao", is_torchao_available),
            "quanto": ("optimum-quanto", "optimum/quanto", is_optimum_quanto_available)}
SKIP_REASON = ("{} is not installed: pip install 'hf-mhc[torchao,quant]' (make test puts torchao and optimum-quanto "
               "in .venv/quant-site)")
WORKER_TIMEOUT_S = 600  # the first quanto call may build its C++ extension


def site_for(method: str) -> str | None:
    """The ``PYTHONPATH`` entry from which the worker imports ``method``'s package: ``QUANT_SITE``, or ``""`` where it
    is installed in this environment; ``None`` where it is nowhere."""
    _, folder, available_here = PACKAGES[method]
    if (QUANT_SITE / folder / "__init__.py").is_file():
        return str(QUANT_SITE)
    return "" if available_here() else None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path, set[str]]:
    """A tiny Llama (perturbed norms, logits of a few units) and the mHC model upcycled from it, saved; the names of
    the mHC model's HC parameters."""
    folder = tmp_path_factory.mktemp("quantized_weights")
    torch.manual_seed(0)
    source = perturbed_source_model("llama")
    source.save_pretrained(folder / "source")
    upcycled = hf_mhc.upcycle(folder / "source", hc_mult=4)  # from the folder: the card names it
    upcycled.save_pretrained(folder / "mhc")
    torch.save(token_ids(2, 8, seed=0), folder / "ids.pt")
    return folder / "source", folder / "mhc", {name for name, _ in upcycled.named_parameters() if is_hc_parameter(name)}


@pytest.mark.parametrize("method", ["torchao", "quanto"])
def test_int8_weights_leave_the_hc_modules_float32_and_greedy_decoding_equal_to_the_quantized_source(
        checkpoints, method, tmp_path):
    site = site_for(method)
    if site is None:
        pytest.skip(SKIP_REASON.format(PACKAGES[method][0]))
    source, mhc, hc_names = checkpoints
    path = os.pathsep.join(entry for entry in (site, os.environ.get("PYTHONPATH", "")) if entry)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(WORKER), str(source), str(mhc), method, str(source.parent / "ids.pt"),
                           str(tmp_path / "result.pt")], env=env, capture_output=True, text=True,
                          timeout=WORKER_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    result = torch.load(tmp_path / "result.pt", weights_only=False)

    assert result["mhc"]["class"] == "MHCForCausalLM"
    quantized = result["source"]["quantized"]
    # Every Linear weight of the decoder layers, in both models alike (transformers keeps lm_head unquantized).
    assert len(quantized) == 2 * 7 and all(".layers." in name and name.endswith("_proj.weight") for name in quantized)
    assert result["mhc"]["quantized"] == quantized
    for loaded in (result["mhc"], result["mhc_bfloat16"]):
        assert set(loaded["hc"]) == hc_names
        assert set(loaded["hc"].values()) == {("Parameter", "torch.float32")}, loaded["hc"]
    assert result["mhc_bfloat16"]["quantized"] == quantized
    assert result["mhc_bfloat16"]["embedding"] == "torch.bfloat16"  # the backbone did take the dtype asked for

    if method == "torchao":  # saved quantized (quanto's models are not serializable), with the card saying so
        assert "backbone tensors in float32, Linear weights quantized (torchao); HC tensors float32" in (
            result["saved"]["card"])
        assert result["saved"]["quantized"] == quantized and result["saved"]["hc"] == result["mhc"]["hc"]

    generated = {key: _output(result[key]) for key in ("source", "mhc")}
    assert_same_greedy_decoding(generated["mhc"], generated["source"])


def _output(loaded: dict) -> SimpleNamespace:
    """The saved greedy run as ``generate(..., return_dict_in_generate=True)`` returns it."""
    return SimpleNamespace(sequences=loaded["sequences"], logits=loaded["logits"])
