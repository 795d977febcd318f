"""transformers' own parallelism tests (``TensorParallelTesterMixin``, ``FSDPTesterMixin``,
``ExpertParallelTesterMixin``) on mHC models: tiny mHC models loaded with ``from_pretrained(..., distributed_config=
DistributedConfig(...))`` on CPU ranks (gloo) against one process.

The mixins come from the transformers sdist (``tests/transformers_suite.py``), their rank processes from its
``RankPool`` (started once, reused by every test). Each mixin runs only the model types on its allowlist, a choice
among transformers' own models; mHC is the model under test here, so the lists are lifted (``None``, as the mixins
say to run every model with a plan). The FSDP mixin's 4- and 8-rank layouts (HSDP, a 2-D mesh) are skipped:
this suite runs two ranks, within the CPU time of a 2-core CI machine.
"""

from __future__ import annotations

import unittest
import unittest.mock

from transformers import Qwen3MoeConfig
from transformers_suite import MHCModelTester, import_parallel_mixins

from hf_mhc import MHCForCausalLM, MHCForSequenceClassification, MHCModel

tensor_parallel_mixin, fsdp_mixin, expert_parallel_mixin = import_parallel_mixins()
SUITE_RANKS = 2
ALLOWLISTS = (
    (tensor_parallel_mixin, "TP_DISTRIBUTED_TEST_MODEL_TYPES"),
    (fsdp_mixin, "FSDP_DISTRIBUTED_TEST_MODEL_TYPES"),
    (expert_parallel_mixin, "EP_DISTRIBUTED_TEST_MODEL_TYPES"),
)


class MHCMoeModelTester(MHCModelTester):
    """Tiny mHC models on a Qwen3-MoE backbone: 4 experts, 2 per token, in both layers."""

    def backbone_config(self) -> Qwen3MoeConfig:
        return Qwen3MoeConfig(**self.backbone_kwargs(), head_dim=self.hidden_size // self.num_attention_heads,
                              moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)


class MHCSuiteSettings:
    """What the mHC test classes set for the mixins; first among their bases, so that it overrides the mixins."""

    all_model_classes = (MHCModel, MHCForCausalLM, MHCForSequenceClassification)
    model_tester = None  # set in setUp (a class attribute, or the mixins' abstract property stays abstract)
    model_tester_class = MHCModelTester

    def setUp(self):
        self.model_tester = self.model_tester_class(self)
        for module, name in ALLOWLISTS:
            patcher = unittest.mock.patch.object(module, name, None)
            patcher.start()
            self.addCleanup(patcher.stop)

    def _skip_if_insufficient_devices(self, world_size: int) -> None:
        if world_size > SUITE_RANKS:
            self.skipTest(f"needs {world_size} ranks; the hf-mhc suite runs {SUITE_RANKS} (CPU time budget)")


class MHCTensorParallelAndFSDPTest(MHCSuiteSettings, tensor_parallel_mixin.TensorParallelTesterMixin,
                                   fsdp_mixin.FSDPTesterMixin, unittest.TestCase):
    """A Llama backbone."""


class MHCExpertParallelTest(MHCSuiteSettings, expert_parallel_mixin.ExpertParallelTesterMixin,
                            tensor_parallel_mixin.TensorParallelTesterMixin, unittest.TestCase):
    """A Qwen3-MoE backbone (the expert-parallel mixin uses the tensor-parallel one's helpers, whose tests run here
    too). FSDP2 with expert parallelism on it: ``test_native_parallel.py``."""

    model_tester_class = MHCMoeModelTester
