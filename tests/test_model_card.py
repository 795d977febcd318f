"""``hf_mhc.model_card``: the ``README.md`` that ``save_pretrained`` of an upcycled model writes (``hf-mhc convert``'s
is checked in ``test_convert.py``). The Hub's metadata reads back with huggingface_hub's ``ModelCard``, the body says
how the model was made, its usage blocks load the folder with and without the plugin, and a card that hf-mhc did not
write, or that was edited since, is never replaced."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest
from conftest import random_mhc, save_source, tiny_backbone_config
from huggingface_hub import ModelCard
from transformers import AutoConfig, AutoModelForCausalLM

import hf_mhc
from hf_mhc.model_card import TAGS, is_hf_mhc_card, kept_card_message, source_name

pytestmark = pytest.mark.usefixtures("one_thread")


def upcycled_tiny_llama(tmp_path):
    """A tiny Llama saved to ``tmp_path/tiny-llama``, loaded from there and upcycled to 3 streams (identity map)."""
    save_source(tmp_path / "tiny-llama", "llama")
    source = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-llama")
    return hf_mhc.upcycle(source, hc_mult=3, hc_residual_map="identity")


def test_save_pretrained_of_an_upcycled_model_writes_a_card_whose_usage_loads_it(tmp_path, monkeypatch):
    model = upcycled_tiny_llama(tmp_path)
    assert model.config.upcycled_from == "tiny-llama"
    model.save_pretrained(tmp_path / "saved")
    assert AutoConfig.from_pretrained(tmp_path / "saved").upcycled_from == "tiny-llama"  # one place: config.json

    card = ModelCard.load(tmp_path / "saved" / "README.md")
    assert card.data.base_model == "tiny-llama" and card.data.library_name == "transformers"
    assert set(TAGS) <= set(card.data.tags) and "mhc" in card.data.tags
    for fact in ("**hc_mult = 3**", "residual map `identity`", "hc_init = `function_preserving`",
                 "backbone tensors in float32; HC tensors float32", "**Verification:** not verified"):
        assert fact in card.text, fact
    assert str(tmp_path) not in card.content  # the source folder's name, never its path

    # The card's two usage blocks, as pasted, from the folder above the checkpoint: with the plugin, and as remote
    # code in a process where `import hf_mhc` fails.
    with_plugin, remote_code = re.findall(r"```python\n(.*?)```", card.text, re.DOTALL)
    assert "trust_remote_code=True" in remote_code and "import hf_mhc" not in remote_code
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(with_plugin, namespace)
    assert type(namespace["model"]) is hf_mhc.MHCForCausalLM
    script = 'import sys\nsys.modules["hf_mhc"] = None\n' + remote_code + "print(type(model).__module__)\n"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.startswith("transformers_modules"), done.stderr[-2000:]

    model.save_pretrained(tmp_path / "rank1", is_main_process=False)  # other ranks write no card
    assert not (tmp_path / "rank1" / "README.md").exists()


def test_a_model_that_was_not_upcycled_gets_no_card(tmp_path):
    random_mhc().save_pretrained(tmp_path / "fresh")
    source = AutoModelForCausalLM.from_config(tiny_backbone_config("llama"))  # built, not loaded: no name
    hf_mhc.upcycle(source).save_pretrained(tmp_path / "from-config")
    for folder in ("fresh", "from-config"):
        assert AutoConfig.from_pretrained(tmp_path / folder).upcycled_from is None
        assert not (tmp_path / folder / "README.md").exists()


def test_the_source_is_named_by_its_hub_id_or_its_folder_name(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    (tmp_path / "my-model").mkdir()
    monkeypatch.chdir(tmp_path)
    assert source_name("tiny-org/tiny-llama") == "tiny-org/tiny-llama"  # no such folder here: a Hub id
    assert source_name("my-model") == source_name("./my-model/") == source_name(tmp_path / "my-model") == "my-model"
    assert source_name(snapshot) == "tiny-org/tiny-llama"  # a Hub cache snapshot given as a folder
    assert source_name(tmp_path / "gone" / "old-model") == source_name("./old-model") == "old-model"  # deleted since
    assert source_name("") is None and source_name("/") is None


def test_our_card_is_updated_and_one_that_hf_mhc_did_not_write_is_left_as_it_is(tmp_path, caplog):
    model = upcycled_tiny_llama(tmp_path)
    out = tmp_path / "saved"
    model.save_pretrained(out)
    ours = (out / "README.md").read_text()
    assert is_hf_mhc_card(ours) and "20 Sinkhorn iterations" in ours
    model.config.hc_sinkhorn_iters = 7
    model.save_pretrained(out)  # re-saving over our own, unedited card updates it
    assert "7 Sinkhorn iterations" in (out / "README.md").read_text()

    edited = (out / "README.md").read_text() + "\nFine-tuned on my own data.\n"
    for theirs in ("---\nlicense: mit\n---\n# My model\n", edited):  # a card of the user's, and ours edited
        (out / "README.md").write_text(theirs)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            model.save_pretrained(out)
        assert (out / "README.md").read_text() == theirs
        assert [record.getMessage() for record in caplog.records if "README.md" in record.getMessage()] == [
            kept_card_message(out)]


def test_a_wrapped_or_derived_model_class_saves_the_card_of_the_mhc_class_it_is(tmp_path):
    """FSDP2's ``fully_shard`` turns the class into ``FSDPMHCForCausalLM`` (module ``torch.distributed...``), and a
    user may derive from ``MHCForCausalLM``: both save the card whose usage loads an ``AutoModelForCausalLM``."""
    model = upcycled_tiny_llama(tmp_path)
    wrapped = type("FSDPMHCForCausalLM", (hf_mhc.MHCForCausalLM,), {"__module__": "torch.distributed.fsdp._fake"})
    derived = type("MyMHCForCausalLM", (hf_mhc.MHCForCausalLM,), {})
    for cls in (wrapped, derived):
        model.__class__ = cls
        model.save_pretrained(tmp_path / cls.__name__)
        assert type(model) is cls
        card = ModelCard.load(tmp_path / cls.__name__ / "README.md")
        assert f'AutoModelForCausalLM.from_pretrained("{cls.__name__}")' in card.text
