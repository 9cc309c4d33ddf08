"""N-gram prompt lookup (``ngram_propose``) case by case: which occurrence is used, which n wins,
where the proposal is cut, and what must never match (the suffix itself, the padding).

Mutations each was seen to fail on (applied to jspec/speculative/drafters/ngram.py, reverted):
  N1  drop the limit from the match (``run = pos < limit`` in ``_latest_ends``: the suffix
      matches itself, padding matches);
  N2  try n from n_min up instead of n_max down (shortest n first);
  N3  propose k tokens without cutting at the committed text (``num = k`` when found);
  N4  take the earliest occurrence instead of the latest (the smallest matching position);
  N5  forget the earlier comparisons (``run = base & ...`` per n instead of ``run &= ...``: an
      n-token match is then only its first token's).
(Dropping ``(seq_len >= n + 1)`` changes nothing: a match ends before ``seq_len`` and so
cannot have n tokens unless ``seq_len >= n + 1``.)
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
        n_max = n_min + int(rng.integers(0, 7))  # up to 8: SpecConfig's default
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


# ---------------------------------------------------------------- lookup history
# (label, committed tokens, history (requests' texts, oldest first), k, n_max, n_min, expected drafts)
HISTORY_CASES = [
    ("no own match: the history's continuation", [1, 2, 3], [[9, 2, 3, 4, 5]], 3, 3, 1, [4, 5]),
    ("cut at the end of that request's text", [1, 2, 3], [[2, 3, 4], [7, 7, 7]], 3, 2, 1, [4]),
    ("the own text wins at the same n", [2, 3, 8, 1, 2, 3], [[2, 3, 4, 4]], 3, 2, 1, [8, 1, 2]),
    ("a longer match in the history beats a shorter own one", [5, 3, 1, 2, 3], [[1, 2, 3, 6, 6]], 2, 3, 1, [6, 6]),
    ("the latest request in the history wins", [1, 2], [[1, 2, 4], [1, 2, 5]], 1, 2, 2, [5]),
    ("one-token matches are not taken from the history", [7, 3], [[3, 4, 4]], 2, 3, 1, []),
    ("a match at the end of a request's text is not one", [4, 1, 2], [[1, 2], [8, 8]], 2, 2, 1, []),
    ("... so a shorter own match is taken", [2, 9, 1, 2], [[1, 2], [8, 8]], 2, 2, 1, [9, 1]),
    ("the suffix must be committed text", [2], [[0, 2, 7]], 2, 2, 1, []),
]
HISTORY = 12


def _history(texts):
    drafter = NgramDrafter(k=1, history=HISTORY)
    return drafter.remember(drafter.init_params(), texts)["history"]


@pytest.mark.parametrize("label,tokens,texts,k,n_max,n_min,want", HISTORY_CASES, ids=[c[0] for c in HISTORY_CASES])
def test_ngram_propose_with_history(label, tokens, texts, k, n_max, n_min, want):
    buf = np.zeros(SIZE, np.int32)
    buf[:len(tokens)] = tokens
    fn = jax.jit(ngram_propose, static_argnums=(2, 3, 4))
    drafts, num = fn(jnp.asarray(buf), jnp.int32(len(tokens)), k, n_max, n_min, _history(texts))
    assert int(num) == len(want), (num, drafts)
    assert np.asarray(drafts)[:int(num)].tolist() == want


def test_remember_keeps_the_latest_tokens_with_separators():
    drafter = NgramDrafter(k=2, history=8)
    params = drafter.init_params()
    assert np.asarray(params["history"]).tolist() == [-1] * 8
    params = drafter.remember(params, [[1, 2, 3]])
    assert np.asarray(params["history"]).tolist() == [-1, -1, -1, -1, -1, 1, 2, 3]
    params = drafter.remember(params, [[4, 5], [6, 7, 8]])  # the oldest tokens fall off the front
    assert np.asarray(params["history"]).tolist() == [3, -1, 4, 5, -1, 6, 7, 8]
    assert NgramDrafter(k=2).init_params() is None


def _reference_with_history(tokens, texts, size, k, n_max, n_min):
    """The module docstring: per n, the own text's latest match, else (n >= 2) the latest
    match in the history, followed by a token of the same request's text."""
    flat = [t for text in texts for t in [-1, *text]][-size:]
    flat = [-1] * (size - len(flat)) + flat
    s = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if s < n:
            continue
        suffix = tokens[s - n:]
        for i in range(s - n - 1, -1, -1):
            if s >= n + 1 and tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
        if n >= 2:
            for i in range(size - n - 1, -1, -1):
                if flat[i:i + n] == suffix and flat[i + n] != -1:
                    out = []
                    for t in flat[i + n:i + n + k]:
                        if t == -1:
                            break
                        out.append(t)
                    return out
    return []


def test_ngram_propose_with_history_matches_the_reference_on_random_sequences():
    rng = np.random.default_rng(1)
    fn = jax.jit(ngram_propose, static_argnums=(2, 3, 4))
    from_history = 0
    for _ in range(300):
        length = int(rng.integers(1, 9))  # short own texts, so the history often decides
        alphabet = int(rng.integers(2, 6))
        tokens = rng.integers(0, alphabet, length).tolist()
        texts = [rng.integers(0, alphabet, int(rng.integers(1, 7))).tolist() for _ in range(int(rng.integers(0, 4)))]
        k, n_min = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        n_max = n_min + int(rng.integers(0, 3))
        buf = np.zeros(SIZE, np.int32)
        buf[:length] = tokens
        drafts, num = fn(jnp.asarray(buf), jnp.int32(length), k, n_max, n_min, _history(texts))
        want = _reference_with_history(tokens, texts, HISTORY, k, n_max, n_min)
        assert int(num) == len(want) and np.asarray(drafts)[:int(num)].tolist() == want, (tokens, texts, k, n_max, n_min)
        from_history += len(want) > 0 and want != _reference(tokens, k, n_max, n_min)
    assert from_history > 20, from_history  # the history decided 30 of the 300 cases


def test_spec_config_ngram_history():
    from jspec.config import SpecConfig
    from jspec.errors import ConfigError

    d = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "ngram_history": 4096})
    assert d == SpecConfig("ngram", 3, ngram_history=4096)
    assert SpecConfig("hybrid", 4, draft="x", ngram_history=64).ngram_history == 64
    with pytest.raises(ConfigError, match="applies to spec methods 'ngram' and 'hybrid'"):
        SpecConfig("layerskip", 4, layerskip_layers=2, ngram_history=64)
    with pytest.raises(ConfigError, match="ngram_history must be"):
        SpecConfig("ngram", 4, ngram_history=1 << 21)
    with pytest.raises(ConfigError, match="non-negative"):
        SpecConfig.from_dict({"method": "ngram", "ngram_history": -1})
    with pytest.raises(ConfigError, match="must be an integer"):
        SpecConfig.from_dict({"method": "ngram", "ngram_history": "lots"})
