"""DeepSpeed ZeRO worker (one process per rank, gloo on CPU): ``deepspeed_worker.py OUTPUT_DIR``. Runs every scenario
in one launch; rank 0 prints one ``RESULT {json}`` line per scenario, which ``tests/test_deepspeed.py`` checks.

The model is ``../shared/assets/stories260K`` (a real pretrained Llama, tied embeddings) upcycled to mHC when present,
else a tiny random Llama; its HC parameters are then perturbed (a trained model's maps, not the function-preserving
start, so a load that left them at their initial values would show) and it is saved as an mHC folder. Scenarios:

- ``zero2`` and ``zero3``: ``Trainer`` with ``deepspeed={"zero_optimization": {"stage": N}}`` (ZeRO-3 loads the folder
  after the ``TrainingArguments``, so under ``zero.Init``), each rank on its half of every global batch, against one
  process (plain PyTorch AdamW, the same hyperparameters) on the whole batch. The gradients of the first step are read
  with ``deepspeed.utils.safe_get_full_grad`` right before DeepSpeed's optimizer step, and compared within
  ``FLOAT32_RTOL`` of each tensor's scale plus ``gradient_atol``; the parameters after ``STEPS`` steps within
  ``adamw_parameter_atol``. Each saves with ``trainer.save_model`` (ZeRO-3 with
  ``stage3_gather_16bit_weights_on_model_save``) and writes the gathered parameters to ``NAME_expected.pt``.
- ``zero_init_load``: ``from_pretrained`` of the mHC folder under ``zero.Init`` (float32 config): every parameter is a
  ZeRO-3 partition; gathered, each equals the file's tensor bit for bit and keeps its dtype (HC float32), and the
  logits computed on the gathered parameters equal those of a plain load.
- ``upcycle_zero3``: ``hf_mhc.upcycle(AutoModelForCausalLM.from_pretrained(residual_folder))`` under a stage-3 config:
  the result is partitioned, and gathered it equals the upcycle of a plain load bit for bit; then ``Trainer`` ZeRO-3
  trains it for two steps and saves without ``stage3_gather_16bit_weights_on_model_save`` (a DeepSpeed checkpoint,
  which the test converts with ``zero_to_fp32.py``).
- ``bf16_zero2``, ``bf16_zero3``: ``bf16=True`` (DeepSpeed's ``bf16`` section): the dtypes seen inside the forward.
- ``autocast_zero2``, ``autocast_zero3``: DeepSpeed's ``torch_autocast`` section (bfloat16) instead: the same dtypes.

On CPU ranks ``TrainingArguments`` needs ``use_cpu=True`` to see both ranks (without it, transformers' DeepSpeed setup
on CPU reports a world size of 1 and every rank trains on the same rows); the worker checks that the ranks' rows
differ.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's tiny configs and the assets

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from conftest import STORIES260K, tiny_backbone_config  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tolerances import (  # noqa: E402
    FLOAT32_RTOL,
    adamw_parameter_atol,
    assert_close_to_scale,
    gradient_atol,
)
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import hf_mhc  # noqa: E402
from hf_mhc import MHCDecoderLayer, MHCForCausalLM, MHCHyperConnection, MHCHyperHead  # noqa: E402

STEPS = 3
LR = 1e-3
PER_RANK_BATCH, LENGTH, ROWS = 2, 24, 16


def is_hc(name: str) -> bool:
    return "_hc." in name or ".hc_head." in name


def is_zero3(parameter: torch.nn.Parameter) -> bool:
    """Whether ZeRO-3 manages ``parameter``: held as partitions (empty ``data`` outside a gather), or, below DeepSpeed's
    ``stage3_param_persistence_threshold`` once an engine has set it, kept whole on every rank."""
    return hasattr(parameter, "ds_id") and (parameter.data.numel() == 0 or getattr(parameter, "ds_persist", False))


def result(scenario: str, **fields) -> None:
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"scenario": scenario, **fields}), flush=True)


def prepare_folders(out: Path) -> tuple[Path, Path]:
    """The residual source (stories260K, else a tiny Llama saved here) and its upcycled, perturbed mHC folder."""
    residual = STORIES260K if STORIES260K.is_dir() else out / "residual"
    mhc = out / "mhc"
    if dist.get_rank() == 0:
        if not STORIES260K.is_dir():
            torch.manual_seed(0)
            config = tiny_backbone_config("llama", tie_word_embeddings=True, num_hidden_layers=3,
                                          initializer_range=0.2)
            AutoModelForCausalLM.from_config(config).save_pretrained(residual)
        torch.manual_seed(1)
        model = hf_mhc.upcycle(residual)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if is_hc(name):
                    parameter.add_(0.05 * torch.randn_like(parameter))
        model.save_pretrained(mhc)
    dist.barrier()
    return residual, mhc


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def deepspeed_config(stage: int, **extra) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = extra.pop("gather_on_save", True)
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", **extra}


def training_arguments(out: Path, config: dict, steps: int = STEPS, **overrides) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out),
        deepspeed=config,
        use_cpu=True,  # CPU ranks: without it transformers' DeepSpeed setup sees one process
        per_device_train_batch_size=PER_RANK_BATCH,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,  # no clipping: the reference steps plain AdamW
        save_strategy="no",
        logging_steps=1000,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        **overrides,
    )


class ForwardDtypes:
    """Dtypes seen inside the forward (hooks added after DeepSpeed's, so ZeRO-3 parameters are gathered): HC
    parameters, their maps, a backbone projection's weight and its output."""

    def __init__(self):
        self.seen = {"hc_parameters": set(), "hc_shapes_empty": set(), "maps": set(), "backbone_weights": set(),
                     "backbone_outputs": set()}

    def attach(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, (MHCHyperConnection, MHCHyperHead)):
                module.register_forward_pre_hook(self.hyper_connection)
            elif isinstance(module, MHCDecoderLayer):
                module.self_attn.q_proj.register_forward_pre_hook(self.backbone)
                module.self_attn.q_proj.register_forward_hook(self.backbone_output)

    def hyper_connection(self, module, args):
        self.seen["hc_parameters"].update(str(parameter.dtype) for parameter in module.parameters())
        self.seen["hc_shapes_empty"].update(parameter.numel() == 0 for parameter in module.parameters())
        if isinstance(module, MHCHyperConnection):
            with torch.no_grad():
                self.seen["maps"].update(str(coefficients.dtype) for coefficients in module.maps(args[0]))

    def backbone(self, module, args):
        self.seen["backbone_weights"].add(str(module.weight.dtype))

    def backbone_output(self, module, args, output):
        self.seen["backbone_outputs"].add(str(output.dtype))

    def report(self) -> dict:
        return {key: sorted(value) for key, value in self.seen.items()}


class RecordingTrainer(Trainer):
    """``Trainer`` that records each rank's rows, the full gradients of the first step (read right before
    DeepSpeed's optimizer step, which ``accelerator.backward`` runs) and the dtypes inside the forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows: list[torch.Tensor] = []
        self.first_gradients: dict[str, torch.Tensor] = {}
        self.dtypes = ForwardDtypes()
        self.add_callback(_HookEngine(self))

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.rows.append(inputs["input_ids"].detach().clone())
        return super().training_step(model, inputs, num_items_in_batch)


class _HookEngine(TrainerCallback):
    def __init__(self, trainer: RecordingTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        engine = trainer.model_wrapped
        assert isinstance(engine, deepspeed.DeepSpeedEngine), type(engine)
        trainer.dtypes.attach(engine.module)
        step = engine.step

        def step_recording_the_first_gradients(*step_args, **step_kwargs):
            if not trainer.first_gradients:
                for name, parameter in engine.module.named_parameters():  # collectives: every rank, same order
                    trainer.first_gradients[name] = safe_get_full_grad(parameter).detach().clone()
            return step(*step_args, **step_kwargs)

        engine.step = step_recording_the_first_gradients


def global_batches(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each step's global batch: the ranks' rows in rank order."""
    batches = []
    for local in rows:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        batches.append(torch.cat(parts))
    return batches


def gathered_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full float32 parameters DeepSpeed's optimizer holds (a collective)."""
    return {name: safe_get_full_fp32_param(parameter).detach().clone() for name, parameter in model.named_parameters()}


def compare_with_one_process(trainer: RecordingTrainer, reference: MHCForCausalLM) -> dict:
    """Replay the ranks' rows on ``reference`` in one process (whole global batches, plain AdamW); compare the first
    step's gradients and the final parameters."""
    batches = global_batches(trainer.rows)
    rows_differ = not torch.equal(batches[0][:PER_RANK_BATCH], batches[0][PER_RANK_BATCH:])
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    reference_gradients = None
    for batch in batches:
        reference(batch, labels=batch).loss.backward()
        if reference_gradients is None:
            reference_gradients = {name: p.grad.clone() for name, p in reference.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    assert set(trainer.first_gradients) == set(reference_gradients), set(trainer.first_gradients) ^ set(
        reference_gradients)
    atol = gradient_atol(list(reference_gradients.values()))
    gradient_used, gradient_fraction = 0.0, 0.0
    for name, expected in reference_gradients.items():
        got = trainer.first_gradients[name]
        used = assert_close_to_scale(got, expected, rtol=FLOAT32_RTOL, atol=atol, name=f"{name}.grad")
        gradient_used = max(gradient_used, used)
        gradient_fraction = max(gradient_fraction, (got.double() - expected.double()).abs().max().item()
                                / expected.abs().max().item())
    parameters = gathered_parameters(trainer.model_wrapped.module)
    parameter_atol = adamw_parameter_atol(LR, len(batches))
    parameter_error = 0.0
    for name, expected in reference.named_parameters():
        used = assert_close_to_scale(parameters[name], expected, rtol=0.0, atol=parameter_atol, name=name)
        parameter_error = max(parameter_error, used * parameter_atol)
    return {
        "steps": len(batches),
        "rows_differ": rows_differ,
        "gradient_bound_used": gradient_used,
        "gradient_error_of_scale": gradient_fraction,
        "parameter_error": parameter_error,
        "parameter_atol": parameter_atol,
        "dtypes": trainer.dtypes.report(),
        "hc_master_dtypes": sorted({str(parameters[name].dtype) for name in parameters if is_hc(name)}),
    }, parameters


def train_and_compare(out: Path, name: str, stage: int, mhc: Path, plain: MHCForCausalLM, rows: torch.Tensor) -> None:
    args = training_arguments(out / name, deepspeed_config(stage))
    model = AutoModelForCausalLM.from_pretrained(mhc)  # ZeRO-3: under zero.Init, after the TrainingArguments
    partitioned = all(is_zero3(parameter) for parameter in model.parameters())
    trainer = RecordingTrainer(model=model, args=args, train_dataset=Rows(rows))
    trainer.train()
    fields, parameters = compare_with_one_process(trainer, copy.deepcopy(plain).train())
    trainer.save_model(str(out / name))
    if dist.get_rank() == 0:
        torch.save(parameters, out / f"{name}_expected.pt")
    dist.barrier()
    result(name, loaded_partitioned=partitioned, **fields)


def zero_init_load(out: Path, mhc: Path, plain: MHCForCausalLM) -> None:
    """``from_pretrained`` under ``zero.Init``: partitions that gather to the file's tensors and the plain logits."""
    # transformers holds its DeepSpeed config by a weak reference: the TrainingArguments must stay alive.
    args = training_arguments(out / "zero_init_load", deepspeed_config(3))
    model = AutoModelForCausalLM.from_pretrained(mhc).eval()
    file_state = load_file(mhc / "model.safetensors")
    partitioned = all(is_zero3(parameter) for parameter in model.parameters())
    mismatched, dtypes = [], {}
    for name, parameter in model.named_parameters():
        with deepspeed.zero.GatheredParameters([parameter], modifier_rank=None):
            key = name if name in file_state else "model.embed_tokens.weight"  # lm_head tied to the embedding
            if not torch.equal(parameter.data, file_state[key]) or parameter.dtype != file_state[key].dtype:
                mismatched.append(name)
            dtypes.setdefault("hc" if is_hc(name) else "backbone", set()).add(str(parameter.dtype))
    ids = torch.randint(3, plain.config.get_text_config().vocab_size, (2, LENGTH))
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None), torch.no_grad():
        logits = model(ids).logits
        expected = plain.eval()(ids).logits
    # The same parameters and code on one rank: the same sums, bit for bit here; compared to 1e-4 of the logit scale
    # as a reloaded model is (its weights at other addresses may be blocked differently by BLAS on another CPU).
    logit_error = (logits - expected).abs().max().item() / expected.abs().max().item()
    assert args.hf_deepspeed_config.is_zero3()
    result("zero_init_load", partitioned=partitioned, mismatched=mismatched,
           dtypes={key: sorted(value) for key, value in dtypes.items()}, logit_error_of_scale=logit_error)


def upcycle_zero3(out: Path, residual: Path, rows: torch.Tensor) -> None:
    """``hf_mhc.upcycle`` of a model loaded under ZeRO-3, then ``Trainer`` ZeRO-3 saving a DeepSpeed checkpoint."""
    expected = hf_mhc.upcycle(AutoModelForCausalLM.from_pretrained(residual))  # plain: before the stage-3 config
    args = training_arguments(out / "upcycle_zero3", deepspeed_config(3, gather_on_save=False), steps=2)
    source = AutoModelForCausalLM.from_pretrained(residual)
    source_partitioned = all(is_zero3(parameter) for parameter in source.parameters())
    model = hf_mhc.upcycle(source)
    partitioned = all(is_zero3(parameter) for parameter in model.parameters())
    source_still_partitioned = all(is_zero3(parameter) for parameter in source.parameters())
    expected_state = dict(expected.named_parameters())
    mismatched, dtypes = [], {}
    for name, parameter in model.named_parameters():
        with deepspeed.zero.GatheredParameters([parameter], modifier_rank=None):
            if not torch.equal(parameter.data, expected_state[name]) or parameter.dtype != expected_state[name].dtype:
                mismatched.append(name)
            dtypes.setdefault("hc" if is_hc(name) else "backbone", set()).add(str(parameter.dtype))
    trainer = RecordingTrainer(model=model, args=args, train_dataset=Rows(rows))
    loss = trainer.train().training_loss
    parameters = gathered_parameters(trainer.model_wrapped.module)
    trainer.save_model(str(out / "upcycle_zero3"))  # no 16-bit gather: a DeepSpeed checkpoint and zero_to_fp32.py
    if dist.get_rank() == 0:
        torch.save(parameters, out / "upcycle_zero3_expected.pt")
    dist.barrier()
    result("upcycle_zero3", source_partitioned=source_partitioned, partitioned=partitioned,
           source_still_partitioned=source_still_partitioned, mismatched=mismatched,
           dtypes={key: sorted(value) for key, value in dtypes.items()}, loss=loss)


def precision(out: Path, name: str, stage: int, mhc: Path, rows: torch.Tensor, config: dict, **overrides) -> None:
    """One step with a mixed-precision setting: the dtypes seen inside the forward, and of the parameters."""
    args = training_arguments(out / name, deepspeed_config(stage, **config), steps=1, **overrides)
    model = AutoModelForCausalLM.from_pretrained(mhc)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=Rows(rows))
    loss = trainer.train().training_loss
    engine = trainer.model_wrapped
    module_dtypes = {}
    for parameter_name, parameter in engine.module.named_parameters():
        module_dtypes.setdefault("hc" if is_hc(parameter_name) else "backbone", set()).add(str(parameter.dtype))
    master = gathered_parameters(engine.module)
    result(name, loss=loss, dtypes=trainer.dtypes.report(),
           module_parameters={key: sorted(value) for key, value in module_dtypes.items()},
           master_parameters=sorted({str(tensor.dtype) for tensor in master.values()}),
           hc_gradients=sorted({str(gradient.dtype) for n, gradient in trainer.first_gradients.items() if is_hc(n)}))


def main(output_dir: str) -> None:
    out = Path(output_dir)
    dist.init_process_group("gloo")
    residual, mhc = prepare_folders(out)
    plain = MHCForCausalLM.from_pretrained(mhc)  # before any DeepSpeed config: a plain load
    torch.manual_seed(2)
    rows = torch.randint(3, plain.config.get_text_config().vocab_size, (ROWS, LENGTH))
    dist.broadcast(rows, 0)

    train_and_compare(out, "zero2", 2, mhc, plain, rows)
    train_and_compare(out, "zero3", 3, mhc, plain, rows)
    zero_init_load(out, mhc, plain)
    upcycle_zero3(out, residual, rows)
    bf16 = {"bf16": {"enabled": "auto"}}
    autocast = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    precision(out, "bf16_zero2", 2, mhc, rows, bf16, bf16=True)
    precision(out, "bf16_zero3", 3, mhc, rows, bf16, bf16=True)
    precision(out, "autocast_zero2", 2, mhc, rows, autocast)
    precision(out, "autocast_zero3", 3, mhc, rows, autocast)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
