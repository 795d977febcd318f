"""Trainer checkpoints of mHC models resume exactly: an interrupted run, resumed from its last checkpoint, takes the
same steps (losses and final weights) as a run that was never interrupted."""

from __future__ import annotations

import pytest
import torch
from conftest import FLOAT32_TOLERANCES, VOCAB, tiny_backbone_config
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_mhc import MHCConfig, MHCForCausalLM

EXAMPLES, LENGTH, BATCH = 16, 12, 4  # 4 steps per epoch
MAX_STEPS, SAVE_STEPS, CRASH_AFTER_STEP = 8, 3, 5  # the crash loses step 4 and 5; checkpoint-3 is the last one


class SimulatedCrash(RuntimeError):
    """Stands for the process dying mid-run (pre-emption, OOM kill)."""


class CrashAfterStep(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise SimulatedCrash(f"crashed after step {self.step}")


class LossRecordingTrainer(Trainer):
    """Records the exact (unrounded) loss of every training step, with the step it belongs to."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_losses: dict[int, float] = {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.step_losses[self.state.global_step + 1] = (loss[0] if return_outputs else loss).item()
        return loss


def tiny_model(seed: int) -> MHCForCausalLM:
    """A tiny mHC model with attention dropout, so that the checkpoint must also restore the RNG state."""
    torch.manual_seed(seed)
    backbone = tiny_backbone_config("llama", attention_dropout=0.1)
    return MHCForCausalLM(MHCConfig(backbone_config=backbone, hc_mult=3, hc_init="deepseek_v4"))


def token_dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234)
    rows = torch.randint(3, VOCAB, (EXAMPLES, LENGTH), generator=generator)
    return [{"input_ids": row, "labels": row} for row in rows]


def trainer_for(output_dir, model: MHCForCausalLM, callbacks=()) -> LossRecordingTrainer:
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=BATCH,
        max_steps=MAX_STEPS,
        save_steps=SAVE_STEPS,
        logging_steps=1,
        learning_rate=3e-3,
        warmup_steps=2,
        lr_scheduler_type="linear",
        seed=0,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return LossRecordingTrainer(model=model, args=args, train_dataset=token_dataset(), callbacks=list(callbacks))


def test_interrupted_run_resumes_to_the_same_losses_and_weights(tmp_path):
    uninterrupted = trainer_for(tmp_path / "uninterrupted", tiny_model(seed=0))
    uninterrupted.train()
    assert sorted(uninterrupted.step_losses) == list(range(1, MAX_STEPS + 1))

    crashed_dir = tmp_path / "interrupted"
    crashing = trainer_for(crashed_dir, tiny_model(seed=0), callbacks=[CrashAfterStep(CRASH_AFTER_STEP)])
    with pytest.raises(SimulatedCrash):
        crashing.train()
    assert sorted(path.name for path in crashed_dir.glob("checkpoint-*")) == [f"checkpoint-{SAVE_STEPS}"]
    for step in range(1, CRASH_AFTER_STEP + 1):  # same seed: identical until the crash
        assert crashing.step_losses[step] == uninterrupted.step_losses[step], step

    # A fresh process would build the model anew: a different init proves the weights come from the checkpoint.
    resumed = trainer_for(crashed_dir, tiny_model(seed=1))
    resumed.train(resume_from_checkpoint=True)
    assert sorted(resumed.step_losses) == list(range(SAVE_STEPS + 1, MAX_STEPS + 1))
    for step, loss in resumed.step_losses.items():
        assert loss == pytest.approx(uninterrupted.step_losses[step], abs=1e-6), step

    uninterrupted_weights = uninterrupted.model.state_dict()
    for name, tensor in resumed.model.state_dict().items():
        torch.testing.assert_close(tensor, uninterrupted_weights[name], **FLOAT32_TOLERANCES["same_ops"], msg=name)
