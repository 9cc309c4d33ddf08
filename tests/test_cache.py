"""Paged KV cache writes, rollback by length, and page allocation."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.cache import OutOfPagesError, PageAllocator, PagedKVCache, init_cache, write_kv


def test_write_lands_at_block_table_slots():
    tables = jnp.asarray([[3, 0], [1, 2]], jnp.int32)
    pages = jnp.zeros((1, 4, 4, 2), jnp.float32)
    new = jnp.arange(2 * 3 * 1 * 2, dtype=jnp.float32).reshape(2, 3, 1, 2) + 1
    out = write_kv(pages, new, tables, jnp.asarray([2, 5], jnp.int32), jnp.asarray([3, 2], jnp.int32))
    out = np.asarray(out)
    # seq 0 positions 2,3 -> page 3 slots 2,3; position 4 -> page 0 slot 0
    np.testing.assert_array_equal(out[0, 3, 2], new[0, 0, 0])
    np.testing.assert_array_equal(out[0, 3, 3], new[0, 1, 0])
    np.testing.assert_array_equal(out[0, 0, 0], new[0, 2, 0])
    # seq 1 positions 5,6 -> page 2 slots 1,2; its third row is beyond q_len: dropped
    np.testing.assert_array_equal(out[0, 2, 1], new[1, 0, 0])
    np.testing.assert_array_equal(out[0, 2, 2], new[1, 1, 0])
    assert np.count_nonzero(out.any(-1)) == 5


def test_cache_is_a_pytree_and_rollback_is_a_length_change():
    import jax

    c = init_cache(2, 1, 4, jnp.zeros((3, 2), jnp.int32), 6, 4)
    leaves = jax.tree_util.tree_leaves(c)
    assert len(leaves) == 2 + 2 + 2  # 2 layers of K and V pages, block tables, lengths
    chex.assert_shape(c.k_pages + c.v_pages, (1, 6, 4, 4))  # [kv_heads, num_pages, page_size, head_dim]
    chex.assert_shape([c.block_tables, c.lengths], [(3, 2), (3,)])
    chex.assert_type([c.block_tables, c.lengths], jnp.int32)
    c2 = c.replace(lengths=c.lengths + 5)
    rolled = c2.replace(lengths=c2.lengths - 2)
    assert isinstance(rolled, PagedKVCache)
    chex.assert_trees_all_equal_shapes_and_dtypes(rolled, c)  # the same pytree: a jitted step takes either
    np.testing.assert_array_equal(np.asarray(rolled.lengths), [3, 3, 3])
    assert rolled.k_pages[0] is c.k_pages[0]  # pages untouched by rollback
    assert c.capacity == 8 and c.page_size == 4 and c.num_layers == 2


def test_allocator_hands_out_distinct_pages_and_frees():
    a = PageAllocator(10, 4, shuffle_seed=0)
    t = a.block_tables([5, 9, 1])
    used = [p for row, n in zip(t, [2, 3, 1]) for p in row[:n]]
    assert len(set(used)) == 6 and a.num_free == 4
    assert t.dtype == np.int32 and t.shape == (3, 3)
    with pytest.raises(OutOfPagesError):
        a.allocate(17)
    a.free(list(t[1, :3]))
    assert a.num_free == 7
