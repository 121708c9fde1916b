"""The drafter reads the target layers it was trained on: the features `target_layer_ids` tap in our Transformer (the
forward that training and decode share, `hidden_layers=`) equal those the published DFlash reference takes from HF
transformers (`extract_context_feature` over `output_hidden_states`: layer i is hidden_states[i + 1], the output of
decoder layer i), on the committed HF fixture target. tests/fixtures/dflash_taps was written by
tests/fixtures/make_tap_fixture.py with the reference's own code; moving the tap by one layer fails here."""
import os

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import hf_import
from pallas_kernels import ops

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
TOLERANCE = 1e-4  # max |ours - reference| / max |reference| in float32


def test_tapped_features_are_the_reference_hidden_states():
    reference = np.load(os.path.join(FIXTURES, "dflash_taps", "taps.npz"))
    model = hf_import.load_hf_checkpoint(os.path.join(FIXTURES, "hf_deepseek_v3_bf16"), dtype="float32",
                                         progress=False)
    layer_ids = tuple(int(i) for i in reference["target_layer_ids"])
    with jax.default_matmul_precision("highest"), ops.implementation("reference"):
        hidden = model.causal(jnp.asarray(reference["tokens"]), hidden_layers=layer_ids).hidden
    ours = np.asarray(jnp.concatenate(hidden, axis=-1), np.float64)
    want = np.asarray(reference["features"], np.float64)
    assert ours.shape == want.shape
    assert np.abs(ours - want).max() / np.abs(want).max() < TOLERANCE
