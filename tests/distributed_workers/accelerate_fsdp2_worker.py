"""Accelerate / Trainer FSDP2 worker (one process per rank, gloo on CPU): ``accelerate_fsdp2_worker.py OUTPUT_DIR``.

Launched by torchrun with the environment ``accelerate launch --config_file examples/accelerate/fsdp2.yaml`` gives its
processes (``ACCELERATE_USE_FSDP``, ``FSDP_*``, ``ACCELERATE_MIXED_PRECISION=bf16``), so the plugin below is the one
that config makes. Accelerate turns FSDP on only for accelerator devices (its state drops the plugin for CPU
processes): :func:`enable_fsdp` sets the state as Accelerate does on GPUs, and from there ``accelerator.prepare`` (and
``Trainer``) run Accelerate's FSDP2 path unchanged: its upcast to float32 master weights, its units and its one bf16
policy (``param_dtype = reduce_dtype = output_dtype = bfloat16``). Four scenarios, one launch:

- plain: ``hf_mhc``'s hook taken out (Accelerate's own ``fsdp2_prepare_model``), to show what the hook changes;
- accelerate: with the hook (what ``import hf_mhc`` installs);
- cpu_ram_efficient_loading: the same with ``cpu_ram_efficient_loading`` (Accelerate shards on the ``meta`` device,
  then broadcasts rank 0's weights into the shards);
- trainer: ``Trainer`` with an FSDP2 ``fsdp_config`` and ``bf16=True``, one optimizer step.

For each, rank 0 prints one ``RESULT {json}`` line: the type and dtype of the HC parameter shards, the dtypes seen
inside the forward (HC parameters, the ``pre`` / ``post`` / ``comb`` maps, backbone weights), of the HC gradients, and
(all but trainer) the largest and the smallest error of an HC gradient against the one-process reference, each as a
fraction of that tensor's largest entry. The reference is the same bf16 model (float32 HC modules) in one process, run
on each rank's rows in turn with the gradients averaged: the computation the bf16 policy asks for, emulated exactly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's tiny configs

import accelerate.accelerator  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from conftest import VOCAB, tiny_backbone_config  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from hf_mhc import MHCConfig, MHCDecoderLayer, MHCForCausalLM, MHCHyperConnection, MHCHyperHead  # noqa: E402

GLOBAL_BATCH, LENGTH = 4, 12


def tiny_config() -> MHCConfig:
    return MHCConfig(
        backbone_config=tiny_backbone_config("llama"),
        hc_mult=3,
        hc_init="deepseek_v4",  # random HC maps: every coefficient is token-dependent and gets a real gradient
    )


def twin_models() -> tuple[MHCForCausalLM, MHCForCausalLM]:
    """Two bf16 models (float32 HC modules) with the same weights: one for Accelerate, one as the reference."""
    torch.manual_seed(0)
    model = MHCForCausalLM._from_config(tiny_config(), dtype=torch.bfloat16).train()
    reference = MHCForCausalLM._from_config(tiny_config(), dtype=torch.bfloat16).train()
    reference.load_state_dict(model.state_dict())
    return model, reference


def enable_fsdp(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """What ``AcceleratorState`` does with an FSDP plugin on GPUs (it keeps the plugin only for accelerator devices).
    Every ``AcceleratorState()`` call copies ``PartialState``'s fields over its own, so both get the FSDP type."""
    plugin.set_mixed_precision(accelerator.state.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    for state in (PartialState(), accelerator.state):
        state.distributed_type = DistributedType.FSDP
    assert accelerator.is_fsdp2 and accelerator.num_processes == dist.get_world_size(), "not FSDP2 on every rank"


class ForwardDtypes:
    """Dtypes seen inside the forward: HC parameters (gathered), their maps, backbone weights (gathered)."""

    def __init__(self, model: torch.nn.Module):
        self.seen = {"hc_parameters": set(), "maps": set(), "backbone_weights": set()}
        for module in model.modules():
            if isinstance(module, (MHCHyperConnection, MHCHyperHead)):
                module.register_forward_pre_hook(self.hyper_connection)  # runs after FSDP2's unshard (prepended)
            elif isinstance(module, MHCDecoderLayer):
                module.self_attn.q_proj.register_forward_pre_hook(self.backbone)
        model.lm_head.register_forward_pre_hook(self.backbone)

    def hyper_connection(self, module, args):
        self.seen["hc_parameters"].update(str(parameter.dtype) for parameter in module.parameters())
        if isinstance(module, MHCHyperConnection):
            with torch.no_grad():
                self.seen["maps"].update(str(coefficients.dtype) for coefficients in module.maps(args[0]))

    def backbone(self, module, args):
        self.seen["backbone_weights"].add(str(module.weight.dtype))

    def report(self) -> dict:
        return {key: sorted(value) for key, value in self.seen.items()}


def hc_names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters() if "_hc." in name or ".hc_head." in name]


def hc_shards(model: torch.nn.Module) -> list[str]:
    return sorted({f"{type(parameter).__name__} {parameter.dtype}" for name, parameter in model.named_parameters()
                   if name in set(hc_names(model))})


def reference_gradients(reference: MHCForCausalLM, batch: torch.Tensor, world_size: int) -> dict[str, torch.Tensor]:
    """The mean over ranks of each rank's gradients: the one-process model on each rank's rows in turn."""
    total: dict[str, torch.Tensor] = {}
    for rows in batch.chunk(world_size):
        reference.zero_grad()
        reference(rows, labels=rows).loss.backward()
        for name, parameter in reference.named_parameters():
            total[name] = total.get(name, 0) + parameter.grad.float()
    return {name: gradient / world_size for name, gradient in total.items()}


def fsdp2_accelerator(cpu_ram_efficient_loading: bool) -> Accelerator:
    """A fresh ``Accelerator`` with the FSDP2 plugin of the launch environment, as ``accelerate launch`` makes it."""
    AcceleratorState._reset_state()
    plugin = FullyShardedDataParallelPlugin()
    plugin.cpu_ram_efficient_loading = cpu_ram_efficient_loading
    accelerator = Accelerator(fsdp_plugin=plugin)  # mixed precision from the environment too
    enable_fsdp(accelerator, plugin)
    return accelerator


def accelerate_step(rank: int, world_size: int, cpu_ram_efficient_loading: bool = False) -> dict:
    model, reference = twin_models()
    names = hc_names(model)
    accelerator = fsdp2_accelerator(cpu_ram_efficient_loading)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    recorder = ForwardDtypes(model)
    batch = torch.randint(3, VOCAB, (GLOBAL_BATCH, LENGTH))
    local = batch.chunk(world_size)[rank]
    accelerator.backward(model(local, labels=local).loss)
    expected = reference_gradients(reference, batch, world_size)
    parameters = dict(model.named_parameters())
    errors = {}
    for name in names:
        gradient = parameters[name].grad.full_tensor().double()  # a collective: every rank, same order
        scale = expected[name].abs().max().item()
        errors[name] = (gradient - expected[name].double()).abs().max().item() / scale
    worst, best = max(errors, key=errors.get), min(errors, key=errors.get)
    return {
        "hc_shards": hc_shards(model),
        **recorder.report(),
        "hc_gradients": sorted({f"{type(parameters[n].grad).__name__} {parameters[n].grad.dtype}" for n in names}),
        "hc_gradient_error": errors[worst],
        "hc_gradient_worst": worst,
        "hc_gradient_least_error": errors[best],
    }


class TinyTexts(torch.utils.data.Dataset):
    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


class FSDPTrainer(Trainer):
    """``Trainer`` with its FSDP plugin kept on CPU (:func:`enable_fsdp`); nothing else changes."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        enable_fsdp(self.accelerator, FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
        self.is_fsdp_enabled = True


class GradientDtypes(TrainerCallback):
    """The HC gradients' types and dtypes before the optimizer step."""

    def __init__(self):
        self.seen: set[str] = set()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        names = set(hc_names(model))
        self.seen.update(f"{type(p.grad).__name__} {p.grad.dtype}" for n, p in model.named_parameters() if n in names)


def trainer_step(output_dir: Path) -> dict:
    model, _ = twin_models()
    recorder = ForwardDtypes(model)
    gradients = GradientDtypes()
    args = TrainingArguments(
        output_dir=str(output_dir / "trainer"),
        fsdp="full_shard",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["MHCDecoderLayer"]},
        bf16=True,
        use_cpu=True,  # bf16 on CPU needs it said
        per_device_train_batch_size=GLOBAL_BATCH // dist.get_world_size(),
        max_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = FSDPTrainer(model=model, args=args, train_dataset=TinyTexts(torch.randint(3, VOCAB, (8, LENGTH))),
                          callbacks=[gradients])
    loss = trainer.train().training_loss
    assert trainer.is_fsdp_enabled and trainer.accelerator.is_fsdp2
    return {
        "hc_shards": hc_shards(trainer.model),
        **recorder.report(),
        "hc_gradients": sorted(gradients.seen),
        "loss": loss,
    }


def main(output_dir: str) -> None:
    PartialState(cpu=True)  # the gloo process group of the torchrun ranks
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {}
    hooked = accelerate.accelerator.fsdp2_prepare_model
    accelerate.accelerator.fsdp2_prepare_model = hooked.__wrapped__
    try:
        results["plain"] = accelerate_step(rank, world_size)
    finally:
        accelerate.accelerator.fsdp2_prepare_model = hooked
    results["accelerate"] = accelerate_step(rank, world_size)
    results["cpu_ram_efficient_loading"] = accelerate_step(rank, world_size, cpu_ram_efficient_loading=True)
    AcceleratorState._reset_state()  # Trainer makes its own Accelerator
    results["trainer"] = trainer_step(Path(output_dir))
    if rank == 0:
        for scenario, result in results.items():
            print("RESULT " + json.dumps({"scenario": scenario, **result}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
