"""``recurrent_step`` against a token-by-token loop in numpy: final states in the rows' slots, the
tracked state in its slot, zero state where a row starts, padding tokens changing nothing."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention import StateMetadata, recurrent_step
from kvjax.pools import CachePools
from kvjax.pools.recurrent import RecurrentStatePool
from tests.attention.batches import batch_metadata

CONV, KERNEL, SSM = 3, 3, (1, 2, 2)


def _update(window, state, g):
    new = state * g + window.sum()
    return new, new.sum()


def test_recurrent_step_equals_a_token_loop():
    rng = np.random.default_rng(5)
    pool = RecurrentStatePool.create(
        num_slots=4, layer_ids=(0,), conv_state_shapes=((CONV, KERNEL - 1),), ssm_state_shape=SSM, conv_dtype="float32"
    )
    conv_init = rng.standard_normal((1, CONV, KERNEL - 1)).astype(np.float32)
    ssm_init = rng.standard_normal((1, *SSM)).astype(np.float32)
    pool = pool.set_states(0, np.array([2]), (conv_init,), ssm_init)
    # Row 0 starts in slot 1 (tracked after its 4th token into slot 3); row 1 continues slot 2.
    state = StateMetadata(
        state_slots=np.array([1, 2, 0], np.int32),
        has_initial_state=np.array([0, 1, 0], np.int32),
        track_slots=np.array([3, 0, 0], np.int32),
        track_at=np.array([4, 0, 0], np.int32),
    )
    meta = batch_metadata().with_parts(state)
    x = rng.standard_normal((8, CONV)).astype(np.float32)
    g = rng.uniform(0.5, 1.0, 8).astype(np.float32)
    out, new = recurrent_step(CachePools(recurrent=pool), 0, jnp.asarray(x), (jnp.asarray(g),), _update, meta)

    want_out = np.zeros(8, np.float32)
    finals, tracked = {}, None
    for row, (begin, end) in enumerate([(0, 5), (5, 7)]):
        conv = conv_init[0] if row == 1 else np.zeros((CONV, KERNEL - 1), np.float32)
        st = ssm_init[0] if row == 1 else np.zeros(SSM, np.float32)
        for i in range(begin, end):
            window = np.concatenate([conv, x[i][:, None]], axis=1)
            st = st * g[i] + window.sum()
            want_out[i] = st.sum()
            conv = window[:, 1:]
            if row == 0 and i - begin + 1 == 4:
                tracked = (conv, st)
        finals[int(state.state_slots[row])] = (conv, st)
    np.testing.assert_allclose(np.asarray(out)[:7], want_out[:7], rtol=1e-5)
    (conv_got,), ssm_got = new.recurrent.get_states(0, np.array([1, 2, 3]))
    for j, slot in enumerate([1, 2]):
        np.testing.assert_allclose(np.asarray(conv_got[j]), finals[slot][0], rtol=1e-5)
        np.testing.assert_allclose(np.asarray(ssm_got[j]), finals[slot][1], rtol=1e-5)
    assert tracked is not None
    np.testing.assert_allclose(np.asarray(conv_got[2]), tracked[0], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ssm_got[2]), tracked[1], rtol=1e-5)


def test_recurrent_step_without_state_metadata_says_what_is_missing():
    pool = RecurrentStatePool.create(
        num_slots=1, layer_ids=(0,), conv_state_shapes=((CONV, KERNEL - 1),), ssm_state_shape=SSM
    )
    with pytest.raises(ValueError, match="AttentionMetadata.state"):
        recurrent_step(CachePools(recurrent=pool), 0, jnp.zeros((8, CONV)), (jnp.zeros(8),), _update, batch_metadata())
