"""``hf_mhc.diagnostics.callback``: ``MHCStabilityCallback`` logs the stability report through ``Trainer.log``."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB
from datasets import Dataset
from diagnostics_helpers import three_layer_mhc_model
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_mhc.diagnostics import report_scalars, stability_report
from hf_mhc.diagnostics.callback import MHCStabilityCallback


class LogRecorder(TrainerCallback):
    """Stands in for a reporting integration (TensorBoard, W&B): records what on_log hands it."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((state.global_step, dict(logs)))


def test_callback_logs_the_scalars_through_trainer_every_n_steps(tmp_path):
    model = three_layer_mhc_model(hc_mult=4).train()
    blocks = torch.randint(3, VOCAB, (16, 12))
    train_set = Dataset.from_dict({"input_ids": blocks.tolist(), "labels": blocks.tolist()})
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=2,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
    )
    recorder = LogRecorder()
    trainer = Trainer(model=model, args=args, train_dataset=train_set, callbacks=[recorder])
    before = report_scalars(stability_report(model, blocks[:3]))
    trainer.add_callback(MHCStabilityCallback(every_n_steps=2, trainer=trainer, num_samples=3))
    trainer.train()

    stability_steps = [step for step, logs in recorder.logs if "mhc/composite_forward_gain" in logs]
    assert stability_steps == [0, 2, 4]
    loss_steps = [step for step, logs in recorder.logs if "loss" in logs]
    assert loss_steps == [2, 4]  # the trainer's own logs still happen at the logging steps
    history = [entry for entry in trainer.state.log_history if "mhc/composite_forward_gain" in entry]
    assert [entry["step"] for entry in history] == [0, 2, 4]
    assert history[0]["mhc/max_comb_row_sum_deviation"] == pytest.approx(before["mhc/max_comb_row_sum_deviation"])
    assert history[0]["mhc/stream_cosine_mean"] == pytest.approx(before["mhc/stream_cosine_mean"])
    # Training moved the HC maps, and the logged report follows them.
    assert history[-1]["mhc/pre_max"] != history[0]["mhc/pre_max"]
    # The first report names the variant it measured (once: a string is text, not a scalar, to the integrations).
    assert [entry.get("mhc/hc_residual_map") for entry in history] == ["sinkhorn", None, None]
    assert [logs.get("mhc/hc_residual_map") for step, logs in recorder.logs if step == 0] == ["sinkhorn"]


def test_callback_rejects_bad_arguments():
    args = TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    trainer = Trainer(model=three_layer_mhc_model(), args=args)
    with pytest.raises(ValueError, match="every_n_steps"):
        MHCStabilityCallback(every_n_steps=0, trainer=trainer)
    with pytest.raises(TypeError, match="Trainer"):
        MHCStabilityCallback(every_n_steps=5, trainer=object())
