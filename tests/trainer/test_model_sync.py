"""The caller's own module object holds the trained values after fit, despite buffer donation."""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer


def test_callers_module_is_usable_and_trained_after_fit(classification_arrays):
    x, y = classification_arrays
    module = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    initial = np.asarray(module.kernel[...]).copy()
    trainer = Trainer(ComposerClassifier(module, 2), ArrayLoader((x, y), 16), "2ep", optax.adam(1e-2),
                      progress_bar=False)
    trainer.fit()
    trained = jax.device_get(trainer.state.train_state["params"]["module"]["kernel"])
    np.testing.assert_array_equal(np.asarray(module.kernel[...]), trained)  # no "Array has been deleted"
    assert not np.allclose(trained, initial)
    np.testing.assert_allclose(np.asarray(module(x[:3])), x[:3] @ trained + np.asarray(module.bias[...]), rtol=1e-5)
    trainer.fit("1ep")  # training continues from the synced values without a retrace
    assert trainer.compile_count == 1
    assert not np.allclose(np.asarray(module.kernel[...]), trained)
