"""N-gram prompt lookup (``ngram_propose``) case by case: which occurrence is used, which n wins,
where the proposal is cut, and what must never match (the suffix itself, the padding).

Mutations each was seen to fail on (applied to jspec/speculative/drafters/ngram.py, reverted):
  N1  drop ``(pos + n < seq_len)`` from the match (the suffix matches itself, padding matches);
  N2  try n from n_min up instead of n_max down (shortest n first);
  N3  propose k tokens without cutting at the committed text (``num = k`` when found);
  N4  take the earliest occurrence instead of the latest (``jnp.min`` over matching positions).
(Dropping ``(seq_len >= n + 1)`` changes nothing: ``pos + n < seq_len`` already implies it.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.speculative.drafters.ngram import NgramDrafter, ngram_propose

SIZE = 16  # token buffer length; positions >= seq_len are padding (zeros)

# (label, committed tokens, k, n_max, n_min, expected real drafts)
CASES = [
    ("no match", [1, 2, 3, 4], 3, 2, 1, []),
    ("one match, continuation to the end", [5, 6, 7, 5, 6], 3, 2, 1, [7, 5, 6]),
    ("the latest occurrence wins", [1, 2, 9, 1, 2, 8, 1, 2], 3, 2, 2, [8, 1, 2]),
    ("the longest n wins", [3, 4, 7, 9, 4, 5, 3, 4], 3, 2, 1, [7, 9, 4]),
    ("a shorter n when the longest has no match", [8, 4, 5, 9, 1, 4], 3, 3, 1, [5, 9, 1]),
    ("cut at the committed text", [1, 2, 1], 4, 1, 1, [2, 1]),
    ("cut at k", [1, 2, 3, 4, 5, 6, 1], 3, 1, 1, [2, 3, 4]),
    ("an overlapping occurrence", [4, 4, 4], 3, 2, 2, [4]),
    ("padding never matches", [7, 0], 3, 1, 1, []),
    ("zeros in the text do match", [0, 3, 0], 2, 1, 1, [3, 0]),
    ("a sequence as long as n", [6, 6], 2, 2, 2, []),
    ("one token", [6], 2, 1, 1, []),
    ("k = 1", [5, 6, 7, 5], 1, 1, 1, [6]),
    ("n_min bounds the search", [3, 9, 9, 3], 2, 3, 2, []),
    ("the suffix itself is not an occurrence", [1, 2, 3, 1, 2, 3], 4, 3, 3, [1, 2, 3]),
]


def _propose(tokens, k, n_max, n_min):
    buf = np.zeros(SIZE, np.int32)
    buf[:len(tokens)] = tokens
    drafts, num = jax.jit(ngram_propose, static_argnums=(2, 3, 4))(jnp.asarray(buf), jnp.int32(len(tokens)),
                                                                   k, n_max, n_min)
    return np.asarray(drafts), int(num)


@pytest.mark.parametrize("label,tokens,k,n_max,n_min,want", CASES, ids=[c[0] for c in CASES])
def test_ngram_propose_table(label, tokens, k, n_max, n_min, want):
    drafts, num = _propose(tokens, k, n_max, n_min)
    assert drafts.shape == (k,)
    assert num == len(want), (num, drafts)
    assert drafts[:num].tolist() == want


def _reference(tokens, k, n_max, n_min):
    """The module docstring, literally: for n = n_max..n_min, the latest i < len - n with
    tokens[i:i+n] == the last n tokens; propose tokens[i+n : i+n+k]."""
    s = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if s < n + 1:
            continue
        suffix = tokens[s - n:]
        for i in range(s - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_propose_matches_the_reference_on_random_sequences():
    """Small alphabets make repeats (and so matches of every n) common."""
    rng = np.random.default_rng(0)
    fn = jax.jit(ngram_propose, static_argnums=(2, 3, 4))
    checked = 0
    for _ in range(300):
        length = int(rng.integers(1, SIZE + 1))
        tokens = rng.integers(0, int(rng.integers(2, 5)), length).tolist()
        k, n_min = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        n_max = n_min + int(rng.integers(0, 3))
        buf = np.zeros(SIZE, np.int32)
        buf[:length] = tokens
        drafts, num = fn(jnp.asarray(buf), jnp.int32(length), k, n_max, n_min)
        want = _reference(tokens, k, n_max, n_min)
        assert int(num) == len(want) and np.asarray(drafts)[:int(num)].tolist() == want, (tokens, k, n_max, n_min)
        checked += len(want) > 0
    assert checked > 150  # most cases had a match


def test_drafter_batches_rows_independently():
    """The drafter vmaps the proposer: each row of a batch gets its own proposal and count."""
    from types import SimpleNamespace

    rows = [[5, 6, 7, 5, 6], [1, 2, 3, 4], [4, 4, 4]]
    buf = np.zeros((3, SIZE), np.int32)
    for i, r in enumerate(rows):
        buf[i, :len(r)] = r
    state = SimpleNamespace(tokens=jnp.asarray(buf), seq_lens=jnp.asarray([len(r) for r in rows], jnp.int32),
                            drafter=None, cache=None)
    prop = NgramDrafter(k=3, n_max=2, n_min=1).propose(None, None, state, None)
    assert np.asarray(prop.num_drafts).tolist() == [3, 0, 1]
    assert np.asarray(prop.drafts)[0].tolist() == [7, 5, 6] and np.asarray(prop.drafts)[2, :1].tolist() == [4]
