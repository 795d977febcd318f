"""``hf_mhc.planning`` and ``hf-mhc plan``: the seeds' KV-cache figures, the real ``DynamicCache`` of every family
(residual and mHC), parameter bytes of the real models and their split per device, mHC traffic and pipeline-boundary
bytes by hand, and the activation cases a plan reports (the counting itself is test_activation_count.py's)."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist
from activation_helpers import COUNT_BATCH, COUNT_TOKENS, TRAINING_CASES, real_held
from conftest import FAMILY_SETTINGS, MOE_FAMILIES, OLD_CHECKPOINT, needs_torch, tiny_backbone_config
from distributed_workers import native_worker
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers_suite import run_distributed

import hf_mhc
from hf_mhc import MHCConfig, MHCForCausalLM
from hf_mhc.activation_count import ACTIVATION_CASES
from hf_mhc.cli import main
from hf_mhc.planning import format_plan, plan_memory
from hf_mhc.profiling import cache_bytes

TOKENS = 11  # more than every tiny sliding window (Mistral 6, Gemma 3 4, Qwen2's below 5)
GiB = 2**30

# Every supported family, and Qwen2 with its sliding window switched on above layer 0.
CASES = {family: tiny_backbone_config(family) for family in FAMILY_SETTINGS}
CASES["qwen2_sliding"] = tiny_backbone_config("qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1)


def test_seed_figures():
    mha = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=11008)
    assert plan_memory(mha, tokens=8192, dtype="float16").kv_cache_bytes == 4 * GiB
    plan = plan_memory(mha, tokens=131072, dtype="float16", hc_mult=4)
    assert plan.kv_cache_bytes == 64 * GiB and plan.attention == "MHA"
    assert "mHC leaves the KV cache unchanged" in plan.kv_cache_note
    gqa = plan_memory(LlamaConfig(num_hidden_layers=32, num_key_value_heads=8), tokens=8192, dtype="float16")
    assert gqa.attention == "GQA" and gqa.kv_cache_bytes == GiB
    deepseek = plan_memory(AutoConfig.for_model("deepseek_v3"), tokens=1000, dtype="bfloat16", hc_mult=4)
    assert deepseek.attention == "MLA" and deepseek.num_layers == 61
    assert deepseek.kv_cache_bytes_per_token == 61 * (512 + 64) * 2 == 70_272
    assert deepseek.kv_cache_bytes == 70_272 * 1000


@pytest.mark.parametrize("case", list(CASES))
def test_kv_cache_and_parameters_equal_the_real_models(case, one_thread):
    backbone = CASES[case]
    residual = AutoModelForCausalLM.from_config(backbone).eval()
    mhc_config = MHCConfig(backbone_config=backbone.to_dict(), hc_mult=2)
    mhc = MHCForCausalLM(mhc_config).eval()
    input_ids = torch.randint(3, 100, (2, TOKENS))
    for model, config in ((residual, backbone), (mhc, mhc_config)):
        with torch.no_grad():
            cache = model(input_ids, use_cache=True).past_key_values
        plan = plan_memory(config, tokens=TOKENS, batch=2, dtype="float32")
        assert plan.kv_cache_bytes == cache_bytes(cache), (case, type(model).__name__)
        assert plan.parameter_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
        assert plan.hc_parameter_bytes == (0 if model is residual else sum(
            p.numel() * 4 for name, p in model.named_parameters() if "_hc" in name or "hc_head" in name))
    if case == "deepseek_v3":  # the latent as the "key", the rotary key as the "value"
        layer = cache.layers[0]
        assert layer.keys.shape == (2, 1, TOKENS, backbone.kv_lora_rank)
        assert layer.values.shape == (2, 1, TOKENS, backbone.qk_rope_head_dim)


@pytest.mark.parametrize("residual_map", ["sinkhorn", "unconstrained", "identity", "permutations"])
def test_hc_parameter_bytes_follow_the_residual_map(residual_map):
    """The maps' projections differ in rows: 2n + n*n (sinkhorn, unconstrained), 2n (identity), 2n + n! (permutations).
    The map comes from an MHCConfig, or from ``residual_map`` for a backbone config."""
    backbone = tiny_backbone_config("llama")
    config = MHCConfig(backbone_config=backbone.to_dict(), hc_mult=3, hc_residual_map=residual_map)
    expected = sum(p.numel() * 4 for name, p in MHCForCausalLM(config).named_parameters() if "hc" in name)
    from_config = plan_memory(config, dtype="float32")
    from_backbone = plan_memory(backbone, hc_mult=3, residual_map=residual_map, dtype="float32")
    assert from_config.hc_parameter_bytes == from_backbone.hc_parameter_bytes == expected
    assert from_config.residual_map == from_backbone.residual_map == residual_map


def test_parameter_bytes_in_bfloat16_and_per_device():
    source = AutoModelForCausalLM.from_config(tiny_backbone_config("llama")).to(torch.bfloat16)
    upcycled = hf_mhc.upcycle(source, hc_mult=2)  # backbone in bfloat16, HC in float32
    plan = plan_memory(source.config, tokens=TOKENS, dtype="bfloat16", hc_mult=2)
    assert plan.parameter_bytes == sum(p.numel() * p.element_size() for p in upcycled.parameters())
    # By hand, float32, n = 2, C = 32, 2 layers, vocabulary 101. Llama's TP plan splits q, k, v (32x32, 16x32, 16x32),
    # gate and up (48x32) by rows, o (32x32) and down (32x48) by columns, the embeddings and the LM head (101x32) by
    # rows (51 on rank 0, 50 on rank 1); norms, HC maps, final norm and mHC head are whole on every rank.
    norms = 2 * 32
    site = (2 + 2) * 2 * (2 * 32) + (2 + 2) * 2 + 3  # fn [(n+2)n, nC], base [(n+2)n], scale [3]
    layer = 32 * 32 + 16 * 32 + 16 * 32 + 32 * 32 + 3 * 48 * 32 + norms + 2 * site
    embed, head = 101 * 32, 2 * (2 * 32) + 2 + 1  # hc_fn [n, nC], hc_base [n], hc_scale [1]
    layer_tp2 = layer - (32 * 32 + 16 * 32 + 16 * 32 + 32 * 32 + 3 * 48 * 32) // 2
    embed_tp2 = 51 * 32
    tp2 = plan_memory(source.config, dtype="float32", hc_mult=2, tp=2, pp=2)
    assert tp2.parameter_bytes == 4 * (2 * layer + embed + 32 + head + embed)
    assert tp2.parameter_bytes_per_stage == [4 * (embed_tp2 + layer_tp2), 4 * (layer_tp2 + 32 + head + embed_tp2)]
    assert tp2.layer_weight_bytes == 4 * layer

    def fsdp3(rows: int, row: int = 1) -> int:  # FSDP2 over 3 ranks: ceil(rows / 3) rows of a TP shard on each
        return -(-rows // 3) * row

    layer_tp2_fsdp3 = (fsdp3(16, 32) + 2 * fsdp3(8, 32) + fsdp3(32, 16) + 2 * fsdp3(24, 32) + fsdp3(32, 24)
                       + 2 * fsdp3(32) + 2 * (fsdp3(8, 64) + fsdp3(8) + fsdp3(3)))
    head_fsdp3 = fsdp3(2, 64) + fsdp3(2) + fsdp3(1)
    plan = plan_memory(source.config, dtype="float32", hc_mult=2, tp=2, pp=2, fsdp=3)
    assert plan.parameter_bytes_per_stage == [4 * (fsdp3(51, 32) + layer_tp2_fsdp3),
                                              4 * (layer_tp2_fsdp3 + fsdp3(32) + head_fsdp3 + fsdp3(51, 32))]
    assert plan.parameter_bytes_per_device == max(plan.parameter_bytes_per_stage)
    # Tied embeddings: counted once in all, held by the first stage (embedding) and the last (LM head).
    tied = plan_memory(tiny_backbone_config("llama", tie_word_embeddings=True), dtype="float32", hc_mult=2, tp=2, pp=2)
    assert tied.parameter_bytes == 4 * (2 * layer + embed + 32 + head)
    assert tied.parameter_bytes_per_stage == tp2.parameter_bytes_per_stage


def test_tp_follows_the_models_own_plan_for_a_16_layer_llama():
    """Llama's TP plan splits the embeddings and the LM head too, not only the decoder layers."""
    config = LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=8192, vocab_size=32000)
    layer = 2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 8192 * 2048  # q, o; k, v; gate, up, down: split 4 ways
    per_device = 2 * (16 * (layer // 4 + 2 * 2048) + 2 * 32000 * 2048 // 4 + 2048)
    plan = plan_memory(config, tokens=16, tp=4)
    assert plan.parameter_bytes_per_device == per_device == 552_210_432
    for layout, message in (
        (dict(tp=3), "tp 3 does not divide the 32 attention heads and 8 key/value heads, which the llama TP plan "
                     "splits by head (every rank holds the same whole heads)"),
        (dict(tp=64), "tp 64 does not divide the 32 attention heads"),
        (dict(tp=1_000_000), "tp 1000000 does not divide the 32 attention heads"),
        (dict(fsdp=1_000_000_000), "fsdp 1000000000 exceeds the 32000 rows of model.embed_tokens.weight, the longest "
                                   "dimension 0 of pipeline stage 0's parameters: FSDP2 splits every parameter along "
                                   "dimension 0, so the ranks beyond 32000 would hold only padding"),
        (dict(fsdp=40_000, pp=2), "fsdp 40000 exceeds the 32000 rows of model.embed_tokens.weight"),
    ):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            plan_memory(config, tokens=16, **layout)
    # At most 32000 ranks: one row of each parameter on each (q, k, v, o, gate, up: 2048; down: 8192; a norm: 1).
    assert plan_memory(config, tokens=16, fsdp=32_000).parameter_bytes_per_device == 2 * (
        16 * (6 * 2048 + 8192 + 2) + 2 * 2048 + 1)


def test_tp_splits_heads_only_where_the_plan_does():
    """OLMo 2's plan gathers the attention projections' outputs, so its heads need not divide by tp (as Llama's do);
    a split that leaves a rank nothing of a dimension is refused."""
    olmo2 = tiny_backbone_config("olmo2")  # 4 heads, 2 key/value heads
    plan_memory(olmo2, tokens=4, tp=3)
    with pytest.raises(ValueError, match="^tp 3 does not divide the 4 attention heads and 2 key/value heads"):
        plan_memory(tiny_backbone_config("llama"), tokens=4, tp=3)
    with pytest.raises(ValueError, match=re.escape("tp 12 leaves rank 11 without a slice of "
                                                   "model.layers.0.self_attn.q_proj.weight (its dimension 0 of 32 "
                                                   "splits into slices of 3)")):  # 3 x 10 + 2 + 0
        plan_memory(olmo2, tokens=4, tp=12)
    deepseek = CASES["deepseek_v3"]
    if deepseek.base_model_tp_plan.get("layers.*.mlp.experts.gate_up_proj") == "packed_colwise":  # transformers 5.24
        # MLA attention is not in the plan; the experts' gate and up are packed halves, split each on its own
        first_refused = "model.layers.1.mlp.experts.gate_up_proj (its dimension 1 of 32 splits into slices of 2 per " \
                        "packed half)"
    else:  # 5.25: MLA attention is in the plan, the routed experts are not (expert parallelism places them)
        first_refused = "model.layers.0.self_attn.q_b_proj.weight (its dimension 0 of 64 splits into slices of 6)"
    with pytest.raises(ValueError, match=re.escape(f"tp 12 leaves rank 11 without a slice of {first_refused}")):
        plan_memory(deepseek, tokens=4, tp=12)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_parameter_bytes_per_device_equal_what_transformers_ranks_hold(tmp_path):
    """Two CPU ranks load each checkpoint with transformers' own DistributedConfig(tp_size=2), then fsdp_size=2: the
    most any rank holds equals the plan's bytes per device. Uneven splits: a vocabulary of 97, HC maps of 15 rows,
    the experts' packed gate and up halves of 15."""
    folders = []
    for name, backbone in (("dense", tiny_backbone_config("llama", vocab_size=97)),
                           ("moe", tiny_backbone_config("qwen3_moe", vocab_size=97, moe_intermediate_size=15))):
        MHCForCausalLM(MHCConfig(backbone_config=backbone, hc_mult=3)).save_pretrained(tmp_path / name)
        folders.append(str(tmp_path / name))
    run_distributed(world_size=2)(native_worker.check_planned_parameter_bytes)(folders)


def test_mhc_traffic_and_pipeline_boundary_by_hand():
    config = tiny_backbone_config("llama")  # C = 32
    plan = plan_memory(config, tokens=16, batch=4, dtype="bfloat16", hc_mult=4, pp=2, microbatches=2)
    # Per site, n = 4: unfused reads (5n+1)C = 21C, writes (3n+1)C = 13C; fused: coefficients + pre read nC = 4C and
    # write C, post + comb + residual read (n+1)C = 5C and write nC = 4C. Two sites per layer, 2 bytes per value.
    assert plan.mhc_traffic_unfused_bytes_per_token_layer == 2 * (21 + 13) * 32 * 2
    assert plan.mhc_traffic_fused_bytes_per_token_layer == 2 * (4 + 1 + 5 + 4) * 32 * 2
    assert plan.mhc_traffic_over_weights_decode["fused"] == pytest.approx(
        2 * 14 * 32 * 2 / (plan.layer_weight_bytes / 4))
    assert plan.mhc_traffic_over_weights_prefill["unfused"] == pytest.approx(
        2 * 34 * 32 * 2 / (plan.layer_weight_bytes / (4 * 16)))
    assert plan.pipeline_boundary_bytes_per_microbatch == 2 * 16 * 4 * 32 * 2  # 2 sequences x 16 tokens x nC x 2 B
    assert "8.00 KiB per microbatch (2 microbatches) at each stage boundary" in format_plan(plan)
    residual = plan_memory(config, tokens=16, batch=4, dtype="bfloat16", microbatches=2)
    assert residual.pipeline_boundary_bytes_per_microbatch == 2 * 16 * 32 * 2
    assert residual.mhc_traffic_unfused_bytes_per_token_layer == 0 and residual.hc_parameter_bytes == 0


def test_decode_reads_only_the_routed_experts():
    config = CASES["mixtral"]  # 4 experts, 2 per token
    model = MHCForCausalLM(MHCConfig(backbone_config=config.to_dict(), hc_mult=2))
    experts = other = 0
    for name, p in model.named_parameters():
        if ".layers." in name:
            if ".experts." in name:
                experts += p.numel() * 4
            else:
                other += p.numel() * 4
    one = plan_memory(config, batch=1, dtype="float32", hc_mult=2)
    assert one.layer_weight_bytes_read_per_token_decode == pytest.approx((other + experts / 2) / 2)
    three = plan_memory(config, batch=3, dtype="float32", hc_mult=2)  # 3 tokens x 2 experts: all 4 read
    assert three.layer_weight_bytes_read_per_token_decode == pytest.approx((other + experts) / 2 / 3)
    assert one.layer_weight_bytes == (other + experts) // 2


def test_hf_mhc_plan_prints_a_table_and_writes_json(tmp_path, capsys):
    folder = tmp_path / "mistral"
    CASES["mistral"].save_pretrained(folder)
    out = tmp_path / "plans" / "mistral.json"
    assert main(["plan", str(folder), "--hc-mult", "2", "--tokens", str(TOKENS), "--batch", "2", "--dtype",
                 "float32", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "mHC leaves the KV cache unchanged" in table and "KV cache, workload" in table
    assert "pipeline boundary" not in table  # one stage, no boundary
    numbers = json.loads(out.read_text())
    expected = plan_memory(CASES["mistral"], tokens=TOKENS, batch=2, dtype="float32", hc_mult=2)
    assert numbers["kv_cache_bytes"] == expected.kv_cache_bytes
    assert numbers["kv_cache_bytes_per_token"] == expected.kv_cache_bytes_per_token
    assert numbers["hc_mult"] == 2
    assert numbers["activation_bytes"] == expected.activation_bytes and len(numbers["activation_bytes"]) == 5
    for name, per_token_layer in expected.activation_bytes_per_token_layer.items():
        assert f"  {name}  " in table and f"{per_token_layer:,.0f} B" in table, name
    mhc_folder = tmp_path / "mhc"  # an mHC config plans with its own hc_mult
    MHCConfig(backbone_config=CASES["gemma3_text"].to_dict(), hc_mult=3).save_pretrained(mhc_folder)
    assert main(["plan", str(mhc_folder), "--tokens", str(TOKENS), "--json", str(out)]) == 0
    numbers = json.loads(out.read_text())
    assert numbers["hc_mult"] == 3 and numbers["model_type"] == "gemma3_text"
    assert numbers["kv_cache_bytes"] == plan_memory(CASES["gemma3_text"], tokens=TOKENS).kv_cache_bytes


def test_hf_mhc_plan_turns_bad_input_into_one_line(tmp_path, capsys):
    folder = tmp_path / "llama"
    tiny_backbone_config("llama").save_pretrained(folder)
    (tmp_path / "empty").mkdir()
    for argv, message in (
        ([str(tmp_path / "nope")], f"no such folder: {tmp_path / 'nope'}"),
        ([str(tmp_path / "empty")], f"no config.json in {tmp_path / 'empty'}"),
        ([str(folder), "--batch", "3", "--microbatches", "2"], "batch 3 does not split into 2 equal microbatches"),
        ([str(folder), "--tokens", "0"], "tokens must be a positive integer, got 0"),
        ([str(folder), "--pp", "3"], "pp 3 exceeds the 2 layers"),
        ([str(folder), "--tokens", str(10**19)],
         "tokens 10000000000000000000 exceeds 9223372036854775807 (2^63 - 1), the largest size of a torch tensor"),
        ([str(folder), "--batch", str(10**12), "--tokens", str(10**12)],
         "batch 1000000000000 x 1000000000000 tokens is too large to count the activations: a tensor of the forward "
         "would exceed 9223372036854775807 bytes, the most a torch tensor holds"),
        ([str(folder), "--residual-map", "identity"], "residual_map 'identity' applies to an mHC model; give hc_mult "
                                                      "(hf-mhc plan --hc-mult N) to plan the residual config as one"),
        ([str(folder), "--tp", "3"], "tp 3 does not divide the 4 attention heads and 2 key/value heads, which the "
                                     "llama TP plan splits by head (every rank holds the same whole heads)"),
        ([str(folder), "--fsdp", "102"], "fsdp 102 exceeds the 101 rows of model.embed_tokens.weight, the longest "
                                         "dimension 0 of pipeline stage 0's parameters: FSDP2 splits every parameter "
                                         "along dimension 0, so the ranks beyond 101 would hold only padding"),
        ([str(folder), "--json", str(folder)], f"{folder} is a folder, not a file"),
    ):
        assert main(["plan", *argv]) == 1, argv
        assert capsys.readouterr().err == f"hf-mhc plan: error: {message}\n"
    assert main(["plan", str(folder), "--hc-mult", "9"]) == 1
    assert capsys.readouterr().err.startswith("hf-mhc plan: error: hc_mult must be")


# ---------------------------------------------------------------- activations held for backward


@needs_torch(*OLD_CHECKPOINT)
def test_checkpointed_layers_hold_their_inputs_by_hand():
    """Gradient checkpointing: per layer the hidden states entering it (``n·C`` streams for mHC) and a copy of the
    CPU random state; the rotary ``cos`` and ``sin`` ``[1, T, head_dim]`` in the model's dtype and the position ids
    ``[1, T]`` (int64) that every layer's keyword arguments pass, first held by layer 0."""
    config = tiny_backbone_config("llama")  # C = 32, 2 layers, head_dim 8
    plan = plan_memory(config, tokens=COUNT_TOKENS, batch=COUNT_BATCH, dtype="bfloat16", hc_mult=4)
    rng_state = torch.get_rng_state().numel()
    rotary = 2 * COUNT_TOKENS * 8 * 2 + COUNT_TOKENS * 8
    layers, per_token = config.num_hidden_layers, COUNT_BATCH * COUNT_TOKENS
    for name, width in (("residual + gradient checkpointing", 32), ("mhc + gradient checkpointing", 4 * 32)):
        expected = layers * (per_token * width * 2 + rng_state) + rotary
        assert plan.activation_bytes_per_token_layer[name] * per_token * layers == expected, name
        assert plan.activation_bytes[name] == expected + plan.activation_bytes_outside_layers[name]


def test_the_plan_reports_every_case():
    plan = plan_memory(tiny_backbone_config("qwen3_moe"), tokens=COUNT_TOKENS, batch=COUNT_BATCH, dtype="bfloat16",
                       hc_mult=4)
    assert list(plan.activation_bytes) == [name for name, *_ in ACTIVATION_CASES]
    mhc = plan.activation_bytes_per_token_layer
    assert mhc["mhc + hc_recompute"] < mhc["mhc"] and mhc["mhc + gradient checkpointing"] < mhc["mhc + hc_recompute"]
    assert set(plan.activation_largest_layer_bytes) == {"residual", "mhc", "mhc + hc_recompute"}
    residual = plan_memory(tiny_backbone_config("qwen3_moe"), tokens=COUNT_TOKENS, batch=COUNT_BATCH, dtype="bfloat16")
    assert list(residual.activation_bytes) == ["residual", "residual + gradient checkpointing"]
    assert residual.activation_bytes["residual"] == plan.activation_bytes["residual"]
    assert MOE_FAMILIES  # qwen3_moe: its dense layer 0 and its MoE layer 1 differ
    assert plan.activation_largest_layer_bytes["residual"] * 2 > plan.activation_bytes["residual"] - (
        plan.activation_bytes_outside_layers["residual"])


def test_the_mhc_plan_runs_the_configs_attention(tmp_path, one_thread):
    """A config.json saved with ``attn_implementation: eager`` (the ``T × T`` probabilities held): the mHC cases
    run it too, as ``hf_mhc.upcycle`` of that model does (counted on its real tensors)."""
    folder = tmp_path / "eager"
    tiny_backbone_config("llama").save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**saved, "attn_implementation": "eager"}))
    plan = plan_memory(folder, tokens=COUNT_TOKENS, batch=COUNT_BATCH, dtype="float32", hc_mult=2)
    torch.manual_seed(0)
    upcycled = hf_mhc.upcycle(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).train(), hc_mult=2)
    assert upcycled.config._attn_implementation == "eager"
    for (name, *_), real in zip(ACTIVATION_CASES[2:], real_held(upcycled, TRAINING_CASES), strict=True):
        assert plan.activation_bytes[name] == sum(real.values()), name
