"""transformers' own common model tests (``ModelTesterMixin``, ``TrainingTesterMixin``) on mHC models.

The mixins come from the transformers sdist on PyPI, fetched at test time (``tests/transformers_suite.py``), the way
transformers tests its own DeepSeek-V4: a model tester that builds tiny configs, and overrides only of the checks that
the 4D ``[B, T, n, C]`` hidden states break, each saying why.
"""

from __future__ import annotations

import unittest
import unittest.mock

import torch
from transformers_suite import MHCModelTester, import_transformers_tests

from hf_mhc import MHCConfig, MHCForCausalLM, MHCForSequenceClassification, MHCModel

modeling_common, training_mixin = import_transformers_tests()
class MHCModelCommonTest(modeling_common.ModelTesterMixin, training_mixin.TrainingTesterMixin, unittest.TestCase):
    all_model_classes = (MHCModel, MHCForCausalLM, MHCForSequenceClassification)
    model_tester = None

    def setUp(self):
        self.model_tester = MHCModelTester(self)
        # transformers' tables of model names decide which heads get labels and which classes are base models; an
        # in-tree mHC would be listed there, a plugin registers through the Auto classes instead.
        for table, name in (
            (modeling_common.MODEL_MAPPING_NAMES, "MHCModel"),
            (modeling_common.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "MHCForCausalLM"),
            (modeling_common.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, "MHCForSequenceClassification"),
        ):
            patcher = unittest.mock.patch.dict(table, {MHCConfig.model_type: name})
            patcher.start()
            self.addCleanup(patcher.stop)

    @unittest.skip("GenerationTesterMixin is not in the transformers sdist; tests/test_generation.py covers generate()")
    def test_generation_tester_mixin_inheritance(self):
        pass

    def test_hidden_states_output(self):
        # The common check expects [B, T, C] per layer; mHC layers carry the n streams [B, T, n, C] (as DeepSeek-V4's
        # test accepts). Same count as the common test (one per layer plus the last), each the full 4D stream state.
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        tester = self.model_tester
        for model_class in self.all_model_classes:
            model = model_class(config).eval()
            with torch.no_grad():
                outputs = model(**inputs_dict, output_hidden_states=True)
            hidden_states = outputs.hidden_states
            self.assertEqual(len(hidden_states), tester.num_hidden_layers + 1)
            expected = (tester.batch_size, tester.seq_length, tester.hc_mult, tester.hidden_size)
            for streams in hidden_states:
                self.assertEqual(streams.shape, expected)
