"""Checkpoints written by an earlier hf-mhc load unchanged: a folder saved by ``main`` before the modeling redesign
(its remote-code files are in ``tests/fixtures/main_f1aa4b9``) gives bit-equal logits through the current classes,
and the current code saves it back in the same format.

The old code is run as the remote code it ships as: the fixture's files are loaded with transformers' dynamic-module
loader, build and save a checkpoint, and load it again; the current classes load the same folder. Both read the
same safetensors file the same way and run the same mHC ops (the plugin's), so their logits are compared bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, tiny_backbone_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from hf_mhc import MHCForCausalLM

OLD_MAIN = Path(__file__).resolve().parent / "fixtures" / "main_f1aa4b9"
CODE_FILES = ("configuration_mhc.py", "modeling_mhc.py", "mhc_reference.py")

# (family, hc_mult, residual map, tied embeddings): every wiring kind (pre-norm, Gemma's sandwich norms and scaled
# embeddings with soft-capped logits, Granite's multipliers, OLMo 2's post-norms), MoE with dense layers and latent
# attention, and every residual map.
CASES = {
    "llama": ("llama", 4, "sinkhorn", False),
    "qwen3_moe": ("qwen3_moe", 3, "sinkhorn", False),
    "gemma3_text": ("gemma3_text", 2, "unconstrained", True),
    "granite": ("granite", 4, "permutations", False),
    "olmo2": ("olmo2", 3, "identity", False),
    "deepseek_v3": ("deepseek_v3", 2, "sinkhorn", False),
}


def old_classes(work: Path, name: str):
    """``(MHCConfig, MHCForCausalLM)`` of the old code, imported from a folder holding its files."""
    code = work / f"old_main_{name}"
    code.mkdir()
    for file in CODE_FILES:
        shutil.copyfile(OLD_MAIN / f"{file}.txt", code / file)
    config_class = get_class_from_dynamic_module("configuration_mhc.MHCConfig", code)
    model_class = get_class_from_dynamic_module("modeling_mhc.MHCForCausalLM", code)
    assert not model_class.__module__.startswith("hf_mhc"), model_class.__module__
    return config_class, model_class


@pytest.mark.parametrize("name", CASES)
def test_a_checkpoint_saved_before_the_redesign_loads_to_bit_equal_logits(name, tmp_path, one_thread):
    family, hc_mult, residual_map, tied = CASES[name]
    old_config_class, old_model_class = old_classes(tmp_path, name)
    backbone = tiny_backbone_config(family, num_hidden_layers=3, tie_word_embeddings=tied)
    config = old_config_class(backbone_config=backbone, hc_mult=hc_mult, hc_residual_map=residual_map,
                              hc_init="deepseek_v4", hc_sinkhorn_iters=7)
    folder = tmp_path / "saved_by_old_main"
    old_model_class(config).save_pretrained(folder)
    assert sorted(path.name for path in folder.glob("*.py")) == sorted(CODE_FILES)

    ids = torch.randint(3, VOCAB, (2, 9))
    old = old_model_class.from_pretrained(folder).eval()
    new = MHCForCausalLM.from_pretrained(folder).eval()
    auto = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(auto) is MHCForCausalLM
    with torch.no_grad():
        expected = old(ids, output_hidden_states=True)
        for model in (new, auto):
            got = model(ids, output_hidden_states=True)
            assert torch.equal(got.logits, expected.logits)
            assert len(got.hidden_states) == len(expected.hidden_states)
            assert all(map(torch.equal, got.hidden_states, expected.hidden_states))

    # Saved again, by the old and by the current code: the same tensors under the same names, the same config.
    old.save_pretrained(tmp_path / "old_again")
    new.save_pretrained(tmp_path / "new_again")
    before, after = (load_file(tmp_path / name / "model.safetensors") for name in ("old_again", "new_again"))
    assert before.keys() == after.keys()
    assert all(before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]) for key in before)
    configs = [json.loads((tmp_path / name / "config.json").read_text()) for name in ("old_again", "new_again")]
    assert configs[0] == configs[1]
