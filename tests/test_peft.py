"""PEFT: LoRA on the backbone projections with the HC maps trained in full, saved, reloaded and merged."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import VOCAB, tiny_backbone_config
from peft import PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.utils import ModulesToSaveWrapper
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import hf_mhc
from hf_mhc.conversion import is_hc_parameter
from hf_mhc.diagnostics import inspect_main
from hf_mhc.peft import BACKBONE_PROJECTIONS, HC_MODULE_NAMES, mhc_lora_config


def hc_state(model):
    """The HC tensors that the model's forward uses, keyed by their plain mHC name."""
    state = {}
    for name, param in model.named_parameters():
        if is_hc_parameter(name) and "original_module" not in name:
            plain = name.replace("base_model.model.", "").replace("modules_to_save.default.", "")
            state[plain] = param.detach().clone()
    return state


@pytest.fixture
def upcycled_dir(tmp_path):
    source = LlamaForCausalLM(tiny_backbone_config("llama", num_hidden_layers=2))
    hf_mhc.upcycle(source, hc_mult=4).save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def test_lora_trains_the_hc_maps_and_saves_reloads_and_merges_them(upcycled_dir, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(upcycled_dir)
    base_state = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    model = get_peft_model(base, mhc_lora_config(r=4, lora_alpha=8))

    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable and all("lora_" in name or "modules_to_save" in name for name in trainable)
    assert {name.split(".")[-1] for name in trainable if "modules_to_save" in name} == {
        "fn", "base", "scale", "hc_fn", "hc_base", "hc_scale"
    }
    lora_targets = {name.split(".")[-1] for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    assert lora_targets == set(BACKBONE_PROJECTIONS)

    hc_before = hc_state(model)
    batch = torch.randint(3, VOCAB, (4, 12))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(3):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        if step == 2:  # by now fn has left 0, so the dynamic scales get a gradient too
            hc_grads = {
                name: param.grad for name, param in model.named_parameters()
                if "modules_to_save" in name and is_hc_parameter(name)
            }
            assert all(grad is not None and grad.abs().sum() > 0 for grad in hc_grads.values()), [
                name for name, grad in hc_grads.items() if grad is None or grad.abs().sum() == 0
            ]
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    hc_after = hc_state(model)
    assert hc_after.keys() == hc_before.keys() and len(hc_after) == 2 * 2 * 3 + 3
    assert all(not torch.equal(hc_after[name], hc_before[name]) for name in hc_after if name.endswith("fn"))
    # The frozen backbone and the wrapped originals of the HC modules are untouched.
    for name, tensor in model.get_base_model().state_dict().items():
        plain = name.replace(".base_layer", "").replace("original_module.", "")
        if "lora_" not in name and "modules_to_save" not in name:
            assert torch.equal(tensor, base_state[plain]), name

    model.save_pretrained(tmp_path / "adapter")
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", framework="pt") as adapter:
        saved = set(adapter.keys())
    saved_hc = {key for key in saved if is_hc_parameter(key)}
    assert len(saved_hc) == len(hc_after)
    assert {site for site in HC_MODULE_NAMES if any(f".{site}." in key for key in saved_hc)} == set(HC_MODULE_NAMES)
    assert any("lora_A" in key for key in saved)

    ids = torch.randint(3, VOCAB, (2, 10))
    with torch.no_grad():
        trained_logits = model(input_ids=ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(upcycled_dir)(ids).logits
    assert not torch.allclose(trained_logits, base_logits, atol=1e-4)  # the adapter does something

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(upcycled_dir), tmp_path / "adapter")
    reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trained_logits, rtol=0, atol=1e-6)
    assert all(torch.equal(tensor, hc_after[name]) for name, tensor in hc_state(reloaded).items())

    # hf-mhc inspect reads the adapter folder too (its base is the mHC model it was trained on).
    assert inspect_main([str(tmp_path / "adapter"), "--json", str(tmp_path / "report.json")]) == 0
    inspected = json.loads((tmp_path / "report.json").read_text())["summary"]
    # The trained HC maps, not the base's: the upcycled base has pre = 1/4 exactly at every site.
    assert max(inspected["pre_max"] - 0.25, 0.25 - inspected["pre_min"]) > 1e-3

    merged = reloaded.merge_and_unload()
    assert type(merged) is hf_mhc.MHCForCausalLM
    assert not any(isinstance(module, (LoraLayer, ModulesToSaveWrapper)) for module in merged.modules())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, trained_logits, rtol=1e-5, atol=1e-5)
    merged.save_pretrained(tmp_path / "merged")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert type(again) is hf_mhc.MHCForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, trained_logits, rtol=1e-5, atol=1e-5)


def test_lora_config_keeps_user_choices_and_rejects_hc_targets():
    config = mhc_lora_config(r=2, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], lora_dropout=0.1)
    assert set(config.target_modules) == {"q_proj", "v_proj"}
    assert config.modules_to_save == ["lm_head", *HC_MODULE_NAMES]
    assert config.lora_dropout == 0.1 and config.task_type == "CAUSAL_LM" and config.r == 2
    with pytest.raises(ValueError, match="HC modules"):
        mhc_lora_config(target_modules=["q_proj", "attn_hc"])
    with pytest.raises(ValueError, match="empty"):
        mhc_lora_config(target_modules=[])


def lora_on(model, seed: int = 0):
    """An mhc_lora_config adapter on ``model`` whose LoRA updates are not zero (so it changes the logits)."""
    adapter = get_peft_model(model, mhc_lora_config(r=2))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in adapter.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return adapter.eval()


def test_an_adapter_of_an_in_memory_model_gets_a_clear_error_and_save_adapter_base_avoids_it(
    tmp_path, capsys, monkeypatch
):
    from peft import AutoPeftModelForCausalLM

    from hf_mhc.peft import adapter_base, save_adapter_base

    source = LlamaForCausalLM(tiny_backbone_config("llama"))
    lora_on(hf_mhc.upcycle(source, hc_mult=2)).save_pretrained(tmp_path / "orphan")
    orphan_config = json.loads((tmp_path / "orphan" / "adapter_config.json").read_text())
    assert orphan_config["base_model_name_or_path"] in (None, "")  # null with PEFT 0.21, "" before
    capsys.readouterr()
    assert inspect_main([str(tmp_path / "orphan")]) == 1
    message = capsys.readouterr().err
    assert message.startswith("hf-mhc inspect: error: ") and message.count("\n") == 1
    assert "save the base model first and set base_model_name_or_path" in message and "huggingface.co" not in message
    with pytest.raises(ValueError, match="save the base model first"):
        adapter_base(tmp_path / "orphan")

    model = hf_mhc.upcycle(source, hc_mult=2)
    base_dir = save_adapter_base(model, tmp_path / "base")
    assert base_dir == (tmp_path / "base").absolute() and model.name_or_path == str(base_dir)
    adapter = lora_on(model)
    with pytest.raises(TypeError, match="before get_peft_model"):
        save_adapter_base(adapter, tmp_path / "again")
    adapter.save_pretrained(tmp_path / "adapter")
    assert adapter_base(tmp_path / "adapter") == str(base_dir)
    ids = torch.randint(3, VOCAB, (1, 9))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the base is named by its absolute path
    reloaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, adapter(input_ids=ids).logits, rtol=0, atol=1e-6)
    assert inspect_main([str(tmp_path / "adapter")]) == 0

    # A missing base folder, and a model folder with an adapter beside it (transformers would silently apply it).
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "moved_base")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert inspect_main([str(tmp_path / "adapter")]) == 1
    assert f"no such folder: {tmp_path / 'moved_base'} (the base model named by" in capsys.readouterr().err
    adapter.save_pretrained(base_dir)
    capsys.readouterr()
    assert inspect_main([str(base_dir)]) == 1
    assert "holds both a model (config.json) and a PEFT adapter" in capsys.readouterr().err
