"""transformers' own common model tests (``ModelTesterMixin``, ``TrainingTesterMixin``) on mHC models.

The mixins come from the transformers sdist on PyPI, fetched at test time (``tests/transformers_suite.py``), the way
transformers tests its own DeepSeek-V4: a model tester that builds tiny configs, and overrides only of the checks that
the 4D ``[B, T, n, C]`` hidden states break, each saying why.
"""

from __future__ import annotations

import unittest
import unittest.mock

import torch
from transformers import LlamaConfig
from transformers_suite import import_transformers_tests

from hf_mhc import MHCConfig, MHCForCausalLM, MHCForSequenceClassification, MHCModel

modeling_common, training_mixin = import_transformers_tests()
ids_tensor = modeling_common.ids_tensor


class MHCModelTester:
    """Tiny mHC models on a Llama backbone, with the attributes transformers' mixins read."""

    base_model_class = MHCModel
    causal_lm_class = MHCForCausalLM
    sequence_classification_class = MHCForSequenceClassification
    config_class = MHCConfig

    def __init__(self, parent, batch_size: int = 3, seq_length: int = 7, hc_mult: int = 3):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.hc_mult = hc_mult
        self.is_training = True
        self.vocab_size = 99
        self.hidden_size = 32
        self.num_hidden_layers = 2
        self.num_attention_heads = 4
        self.num_key_value_heads = 2
        self.intermediate_size = 37
        self.max_position_embeddings = 512
        self.num_labels = 3
        self.type_sequence_label_size = 2
        self.pad_token_id = 0
        self.bos_token_id = 1
        self.eos_token_id = 2

    @property
    def all_model_classes(self):
        return (self.base_model_class, self.causal_lm_class, self.sequence_classification_class)

    def backbone_kwargs(self) -> dict:
        """The tiny backbone's shape and special tokens, whatever its family."""
        return dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )

    def backbone_config(self):
        return LlamaConfig(**self.backbone_kwargs())

    def get_config(self) -> MHCConfig:
        # DeepSeek-V4's random initialisation: the maps are token-dependent, so the checks see real mixing.
        return MHCConfig(backbone_config=self.backbone_config(), hc_mult=self.hc_mult, hc_sinkhorn_iters=5,
                         hc_init="deepseek_v4", num_labels=self.num_labels, pad_token_id=self.pad_token_id)

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


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
