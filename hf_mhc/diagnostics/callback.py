"""The Trainer callback that logs the mHC stability report while training (:class:`MHCStabilityCallback`)."""

from __future__ import annotations

import itertools

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .report import SCALAR_PREFIX, report_scalars, stability_report


class MHCStabilityCallback(TrainerCallback):
    """Log :func:`stability_report` scalars through ``Trainer.log`` at the start, every N steps and at the last step.

    The scalars (``mhc/composite_forward_gain``, ``mhc/max_comb_row_sum_deviation``, ... and with ``per_site`` also
    ``mhc/layer_{i}/{attn|ffn}/...``) reach every ``report_to`` integration (TensorBoard, W&B, ...) and
    ``trainer.state.log_history``. The first report also logs which variant was measured, ``mhc/hc_residual_map``
    (a string: TensorBoard records it as text; it is kept as ``hc_residual_map`` on the callback too), so runs of
    different variants share the scalar names and stay comparable on one chart. The report runs on every process
    (so sharded FSDP models work) on a fixed batch:
    ``input_ids`` / ``attention_mask`` when given, else the first ``num_samples`` examples of the trainer's training
    set, collated by its data collator.

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=train_set)
        trainer.add_callback(MHCStabilityCallback(every_n_steps=50, trainer=trainer))
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        trainer: Trainer,
        num_samples: int = 4,
        per_site: bool = False,
    ):
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}.")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples!r}.")
        if attention_mask is not None and input_ids is None:
            raise ValueError("attention_mask given without input_ids.")
        if not isinstance(trainer, Trainer):
            raise TypeError(f"trainer must be a transformers Trainer, got {type(trainer).__name__}.")
        self.every_n_steps = every_n_steps
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.trainer = trainer
        self.num_samples = num_samples
        self.per_site = per_site
        self.last_scalars: dict[str, float] = {}
        self.hc_residual_map: str | None = None

    def _sample_batch(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        dataset = self.trainer.train_dataset
        if dataset is None:
            raise ValueError("MHCStabilityCallback needs input_ids or a Trainer with a train_dataset.")
        examples = [
            {key: example[key] for key in ("input_ids", "attention_mask") if key in example}
            for example in itertools.islice(iter(dataset), self.num_samples)
        ]
        if not examples or "input_ids" not in examples[0]:
            raise ValueError("MHCStabilityCallback: the training set has no 'input_ids' column; pass input_ids.")
        batch = self.trainer.data_collator(examples)
        return torch.as_tensor(batch["input_ids"]), batch.get("attention_mask")

    def _log_report(self, control: TrainerControl) -> None:
        if self.input_ids is None:
            self.input_ids, self.attention_mask = self._sample_batch()
        # trainer.model: the model being trained (PEFT-wrapped, or sharded in place by FSDP2), not a DDP wrapper.
        report = stability_report(self.trainer.model, self.input_ids, self.attention_mask)
        self.last_scalars = report_scalars(report, per_site=self.per_site)
        logs: dict[str, float | str] = dict(self.last_scalars)
        if self.hc_residual_map is None:
            self.hc_residual_map = logs[f"{SCALAR_PREFIX}hc_residual_map"] = report["hc_residual_map"]
        pending_log = control.should_log  # Trainer.log clears it; the trainer's own log of this step must still run
        self.trainer.log(logs)
        control.should_log = pending_log

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs
    ) -> TrainerControl:
        self._log_report(control)
        return control

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs
    ) -> TrainerControl:
        if state.global_step % self.every_n_steps == 0 or state.global_step == state.max_steps:
            self._log_report(control)
        return control


__all__ = ["MHCStabilityCallback"]
