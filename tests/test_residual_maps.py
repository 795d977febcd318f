"""Residual-map variants beside mHC (``hc_residual_map``): the models built on them (training, saving, remote code,
``hc_implementation``, conversion, compile, recomputation). The ops of every map are tested in ``test_kernels.py``.
"""

from __future__ import annotations

import torch
from conftest import (
    VOCAB,
    assert_one_line_error,
    convert,
    save_source,
)

from hf_mhc import MHCForCausalLM

VARIANTS = ["unconstrained", "identity", "permutations"]


# --- models -------------------------------------------------------------------------------------------------------


# --- conversion ---------------------------------------------------------------------------------------------------


def test_convert_with_a_residual_map_writes_it_and_verifies(tmp_path, capsys):
    """``hf-mhc convert --residual-map identity``: config.json keeps the map, the folder loads, verification passes
    (the map's function-preserving start reproduces the source), and the model card names the map."""

    source = save_source(tmp_path / "src", "qwen2")
    status, stdout, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--hc-mult", "3", "--residual-map",
                                  "identity")
    assert status == 0, err
    converted = MHCForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert converted.config.hc_residual_map == "identity"
    assert converted.model.layers[0].attn_hc.fn.shape == (6, 3 * 32)
    assert "residual map `identity`" in (tmp_path / "out" / "README.md").read_text()
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, source(ids).logits, atol=1e-4, rtol=0)


def test_convert_refuses_permutations_of_five_streams_in_one_line(tmp_path, capsys):

    save_source(tmp_path / "src", "llama")
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--hc-mult", "5", "--residual-map",
                             "permutations")
    assert_one_line_error(status, err, "hc_residual_map='permutations' supports hc_mult <= 4")
    assert not (tmp_path / "out").exists()


