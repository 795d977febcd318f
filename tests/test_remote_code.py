"""A saved mHC folder loads through AutoModelForCausalLM on a machine where hf_mhc cannot be imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from conftest import VOCAB, remote_code_logits, tiny_backbone_config

from hf_mhc import MHCConfig, MHCForCausalLM


def test_saved_folder_loads_with_remote_code_without_the_plugin(tmp_path):
    config = MHCConfig(backbone_config=tiny_backbone_config("qwen2"), hc_mult=3, hc_init="deepseek_v4")
    model = MHCForCausalLM(config).eval()
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    ids = torch.randint(0, VOCAB, (2, 7))
    # The plugin runs its own kernels, the remote copy the plain reference formula: equal up to float32 rounding.
    with torch.no_grad():
        torch.testing.assert_close(remote_code_logits(folder, ids, tmp_path), model(ids).logits, atol=1e-5, rtol=1e-5)


WITHOUT_TRITON = textwrap.dedent(
    """
    import sys
    sys.modules["triton"] = None  # as on a platform without Triton
    import torch
    import hf_mhc
    from transformers import LlamaConfig
    config = hf_mhc.MHCConfig(backbone_config=LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                          num_attention_heads=4, vocab_size=50))
    model = hf_mhc.MHCForCausalLM(config)
    model(torch.randint(0, 50, (1, 5)), labels=torch.randint(0, 50, (1, 5))).loss.backward()
    try:
        hf_mhc.apply_mhc_kernels(model)
    except ImportError:
        print("apply_mhc_kernels needs triton")
    """
)


def test_the_plugin_imports_and_trains_without_triton(tmp_path):
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "apply_mhc_kernels needs triton" in result.stdout
