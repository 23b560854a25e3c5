"""transformers' own common model tests (ModelTesterMixin, ConfigTester, GenerationTesterMixin) on VaswaniModel and
VaswaniForConditionalGeneration, as transformers tests MarianMT and BART.

The mixins come from the source distribution of the installed transformers version, fetched from the package
registry by `tests/_transformers_sdist.py` (`.ci/run` fetches it before the suite). Without it (an offline machine)
the whole module is skipped with the reason; VASWANI_REQUIRE_TRANSFORMERS_TESTS=1 (set by `.ci/run`) turns that skip
into a failure, and VASWANI_MIN_TRANSFORMERS_TESTS (also set there) is the least number of them that must pass
(tests/conftest.py counts and prints them).

Skips: the mixins' own conditional ones (no accelerator, no tensor-parallel plan, no RoPE, ...), which MarianMT and
BART get on a CPU as well, and, run from the sdist, the three whose modules it does not ship (GenerationTesterMixin's
tests, ExportTesterMixin's tests and `ConfigTester.check_config_arguments_init`), each with that reason, which holds for
MarianMT and BART alike. With VASWANI_TRANSFORMERS_TESTS pointing at a transformers git checkout they run.
"""

import os
import sys
import unittest
import unittest.mock
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _transformers_sdist  # noqa: E402

from vaswani_hf import VaswaniConfig, VaswaniForConditionalGeneration, VaswaniModel  # noqa: E402

try:
    common = _transformers_sdist.import_common("test_modeling_common")
    config_common = _transformers_sdist.import_common("test_configuration_common")
    generation_utils = _transformers_sdist.import_common("generation.test_utils")
except Exception as error:  # noqa: BLE001 - any reason the sdist is unusable is a reason to skip
    if os.environ.get("VASWANI_REQUIRE_TRANSFORMERS_TESTS") == "1":
        raise
    pytest.skip(f"transformers' common tests are not available ({type(error).__name__}: {error}); run "
                f"`python tests/_transformers_sdist.py` with access to the package registry (PyPI)",
                allow_module_level=True)

ModelTesterMixin = common.ModelTesterMixin
ids_tensor = common.ids_tensor
ConfigTester = config_common.ConfigTester
GenerationTesterMixin = generation_utils.GenerationTesterMixin


class VaswaniModelTester:
    """Small configs and inputs for the common tests (the shape of transformers' MarianModelTester)."""

    def __init__(self, parent, batch_size=13, seq_length=7, is_training=True, use_labels=False, vocab_size=99,
                 hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=4,
                 hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, max_position_embeddings=50,
                 eos_token_id=2, pad_token_id=1, bos_token_id=0, decoder_start_token_id=3):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.use_labels = use_labels
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.decoder_start_token_id = decoder_start_token_id
        self.encoder_seq_length = seq_length
        self.decoder_seq_length = seq_length
        self.key_length = seq_length

    def get_config(self):
        return VaswaniConfig(
            vocab_size=self.vocab_size, d_model=self.hidden_size, encoder_layers=self.num_hidden_layers,
            decoder_layers=self.num_hidden_layers, num_heads=self.num_attention_heads, d_ff=self.intermediate_size,
            dropout=self.hidden_dropout_prob, attention_dropout=self.attention_probs_dropout_prob,
            max_position_embeddings=self.max_position_embeddings, eos_token_id=self.eos_token_id,
            bos_token_id=self.bos_token_id, pad_token_id=self.pad_token_id,
            decoder_start_token_id=self.decoder_start_token_id)

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size).clamp(3)
        input_ids[:, -1] = self.eos_token_id
        decoder_input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size).clamp(3)
        config = self.get_config()
        inputs_dict = {
            "input_ids": input_ids,
            "decoder_input_ids": decoder_input_ids,
            "attention_mask": input_ids.ne(config.pad_token_id),
            "decoder_attention_mask": decoder_input_ids.ne(config.pad_token_id),
        }
        return config, inputs_dict

    def prepare_config_and_inputs_for_common(self):
        return self.prepare_config_and_inputs()


class VaswaniModelTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = (VaswaniModel, VaswaniForConditionalGeneration)
    is_encoder_decoder = True
    test_resize_embeddings = True
    test_missing_keys = True

    def setUp(self):
        self.model_tester = VaswaniModelTester(self)
        # transformers' tests tell a base model from a model with a head by the names in its auto mappings, where
        # Marian and BART are listed; a model registered with the Auto classes is not. Listed for each test only.
        for mapping, name in ((common.MODEL_MAPPING_NAMES, "VaswaniModel"),
                              (common.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, "VaswaniForConditionalGeneration")):
            patcher = unittest.mock.patch.dict(mapping, {"vaswani": name})
            patcher.start()
            self.addCleanup(patcher.stop)
        self.config_tester = ConfigTester(self, config_class=VaswaniConfig, d_model=16)

    def test_config(self):
        # check_config_arguments_init runs as its own test, below: a skip of it is reported, and the others still run
        with unittest.mock.patch.object(self.config_tester, "check_config_arguments_init"):
            self.config_tester.run_common_tests()

    def test_config_arguments_init(self):
        self.config_tester.check_config_arguments_init()


def test_the_common_tests_were_collected():
    """The mixin brought its tests: a broken import path would otherwise leave an empty, passing class."""
    names = [name for name in dir(VaswaniModelTest) if name.startswith("test_")]
    assert len(names) > 100
    assert {"test_encoder_decoder_loss_no_double_shift", "test_save_load", "test_training"} <= set(names)
