"""Sampling parameters at the edges of the dtypes the device computes with (float32 temperature
and top-p, int32 top-k, a 64-bit seed): what ``SamplingParams`` refuses, accepts and normalizes
(table-driven), and that every accepted value gives a distribution, never an empty kept set or
a NaN, in plain sampling, in speculative acceptance and through the engine."""

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from helpers import tiny_config, tiny_model
from jspec.config import FLOAT32_MAX, FLOAT32_TINY, EngineConfig, SamplingParams, SpecConfig, float32
from jspec.engine.engine import LLMEngine
from jspec.sampling import RowSampling, greedy_rows, probs, process_logits, sample
from jspec.speculative.acceptance import greedy_accept, rejection_sample
from jspec.speculative.drafters import DraftModelDrafter, NgramDrafter

REFUSED = [
    (dict(temperature=-1e-300), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=1e39), "temperature"),  # finite in Python, inf in float32
    (dict(temperature=3.4028236e38), "temperature"),  # rounds past float32's largest
    (dict(temperature=10**400), "temperature"),  # no float holds it (OverflowError before)
    (dict(temperature=Fraction(10**400)), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=-0.0), "top_p"),
    (dict(top_p=Fraction(1, 10**400)), "top_p"),  # 0.0 as a float
    (dict(top_p=1.0000001), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_p=10**400), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2**31), "top_k"),  # past int32
    (dict(top_k=1.0), "top_k"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**63), "seed"),
    (dict(seed=1.0), "seed"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2**20 + 1), "max_tokens"),
    (dict(max_tokens=2**31), "max_tokens"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
    (dict(num_speculative_tokens=17), "num_speculative_tokens"),
    (dict(stop=[None]), "stop"),
    (dict(ignore_eos=1), "ignore_eos"),
]


@pytest.mark.parametrize("kw,fragment", REFUSED, ids=[repr(kw)[:40] for kw, _ in REFUSED])
def test_refused_with_a_one_line_config_error(kw, fragment):
    with pytest.raises(jspec.ConfigError, match=fragment) as e:
        SamplingParams(**kw)
    assert "\n" not in str(e.value)


ACCEPTED = [  # (kw, field, stored value)
    (dict(temperature=1e-46), "temperature", 0.0),  # 0 in float32: greedy
    (dict(temperature=1e-40), "temperature", 0.0),  # subnormal in float32: greedy
    (dict(temperature=FLOAT32_TINY * 0.99), "temperature", 0.0),
    (dict(temperature=FLOAT32_TINY), "temperature", FLOAT32_TINY),  # the smallest normal: kept
    (dict(temperature=2e-38), "temperature", 2e-38),
    (dict(temperature=FLOAT32_MAX), "temperature", FLOAT32_MAX),
    (dict(temperature=np.float32(0.7)), "temperature", float(np.float32(0.7))),
    (dict(temperature=7), "temperature", 7.0),
    (dict(top_p=1e-46), "top_p", 1e-46),  # 0 in float32: keeps the top token (below)
    (dict(top_p=5e-324), "top_p", 5e-324),
    (dict(top_p=1 - 1e-9), "top_p", 1 - 1e-9),  # 1 in float32: off
    (dict(top_k=-1), "top_k", 0),
    (dict(top_k=2**31 - 1), "top_k", 2**31 - 1),  # past any vocabulary: off
    (dict(seed=2**63 - 1), "seed", 2**63 - 1),
    (dict(seed=np.uint64(2**63 - 1)), "seed", 2**63 - 1),
    (dict(max_tokens=np.int64(5)), "max_tokens", 5),
    (dict(stop="\ud800"), "stop", ("\ud800",)),  # a lone surrogate is a str like any other
]


@pytest.mark.parametrize("kw,field,value", ACCEPTED, ids=[repr(kw)[:40] for kw, _, _ in ACCEPTED])
def test_accepted_values_and_what_is_stored(kw, field, value):
    sp = SamplingParams(**kw)
    got = getattr(sp, field)
    assert got == value and type(got) is type(value)
    if field == "temperature":
        assert sp.greedy == (value == 0.0)


def test_float32_rounding_helper():
    assert float32(1e-46) == 0.0 and float32(1e39) == math.inf and float32(-1e39) == -math.inf
    assert float32(FLOAT32_MAX) == FLOAT32_MAX and float32(0.1) == float(np.float32(0.1))


# Row parameters at the edges: (temperature, top_k, top_p) as float32 / int32 arrays carry them.
EDGE_ROWS = [
    (1.0, 0, float32(1e-46)),  # top-p 0: the top token only
    (1.0, 0, 1e-40),  # subnormal top-p (flushed to 0 or not: the top token only)
    (1.0, 3, 0.0),
    (0.7, 0, 1e-38),
    (2e-38, 0, 1.0),  # logits / T overflows: greedy
    (2e-38, 5, 0.9),
    (1e-40, 0, 1.0),  # subnormal (SamplingParams makes it 0): greedy or overflowing, never NaN
    (FLOAT32_TINY, 0, 0.5),
    (1e-30, 0, 1.0),  # overflows for logits past 3.4e8 only
    (FLOAT32_MAX, 0, 1.0),  # every logit over it is ~0: uniform
    (FLOAT32_MAX, 7, 0.3),
    (1.0, 2**31 - 1, 1.0),  # top-k past the vocabulary: off
    (1.0, 95, 1.0 - 1e-9),
    (0.0, 3, 1e-46),  # greedy whatever the rest
]


def _edge_rows(n_rep=1):
    t, k, p = zip(*(EDGE_ROWS * n_rep))
    return RowSampling(jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32))


def _deterministic(t, k, p, logits):
    """Rows whose distribution is one-hot on the argmax for these logits (no ties)."""
    if t == 0.0 or float32(p) <= 1e-38:
        return True
    with np.errstate(over="ignore"):
        return not np.isfinite(np.max(logits).astype(np.float32) / np.float32(t))


@pytest.mark.parametrize("scale", [1.0, 100.0, 1e30])
@pytest.mark.parametrize("vocab,levels", [(96, None), (300, (4, 16)), (5000, None)])
def test_every_edge_row_has_a_distribution(scale, vocab, levels):
    """probs: finite, sums to 1, at least one token kept; one-hot on the argmax where the limit
    is (top-p 0, overflowing temperature, greedy); uniform over the kept set for T = 3.4e38.
    The sort-free candidate path (levels) and the full sort agree. sample draws only kept tokens."""
    rs = _edge_rows()
    logits = jax.random.normal(jax.random.key(0), (len(EDGE_ROWS), vocab)) * scale
    x = process_logits(logits, rs, levels=levels)
    p = np.asarray(jnp.where(greedy_rows(logits, rs)[:, None], jax.nn.one_hot(jnp.argmax(logits, -1), vocab),
                             jax.nn.softmax(x, -1)))
    if levels is None:
        np.testing.assert_array_equal(p, np.asarray(probs(logits, rs)))
    assert np.isfinite(p).all() and ((p > 0).sum(-1) >= 1).all()
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
    best = np.argmax(np.asarray(logits), -1)
    for i, (t, k, tp) in enumerate(EDGE_ROWS):
        if _deterministic(t, k, tp, np.asarray(logits[i])):
            assert p[i, best[i]] == 1.0, (i, EDGE_ROWS[i])
        if t == FLOAT32_MAX and scale < 1e30:
            kept = p[i] > 0
            assert kept.sum() == (k if 0 < k < vocab else vocab) or tp < 1
            np.testing.assert_allclose(p[i][kept], 1.0 / kept.sum(), rtol=1e-5)
    keys = jax.random.split(jax.random.key(1), len(EDGE_ROWS))
    tok = np.asarray(sample(keys, logits, rs))
    assert (p[np.arange(len(tok)), tok] > 0).all()


def test_sampling_params_at_the_edges_broadcast_the_same():
    """The SamplingParams path (broadcast, trace-time shortcuts) gives what the row path gives."""
    logits = jax.random.normal(jax.random.key(2), (4, 96)) * 50
    for kw in (dict(temperature=1.0, top_p=1e-46), dict(temperature=2e-38), dict(temperature=1e-40),
               dict(temperature=FLOAT32_MAX, top_k=5), dict(temperature=1.0, top_k=2**31 - 1)):
        sp = SamplingParams(**kw)
        rs = RowSampling.from_params([sp] * 4)
        np.testing.assert_array_equal(np.asarray(probs(logits, sp)), np.asarray(probs(logits, rs)))
        assert np.isfinite(np.asarray(probs(logits, sp))).all()


def test_rejection_sampling_with_edge_rows_stays_on_the_target():
    """Speculative acceptance with p and q processed at every edge row: token ids in range,
    n in [0, k]; where p is one-hot (top-p 0, overflowing or zero temperature) the step equals
    greedy acceptance exactly, whatever q and the draws were."""
    rs = _edge_rows(n_rep=4)
    b, k, v = len(EDGE_ROWS) * 4, 3, 96
    t_logits = jax.random.normal(jax.random.key(3), (b, k + 1, v)) * 30
    d_logits = jax.random.normal(jax.random.key(4), (b, k, v)) * 30
    keys = jax.random.split(jax.random.key(5), b)
    drafts = jnp.stack([sample(jax.random.fold_in(jax.random.key(6), j), d_logits[:, j], rs) for j in range(k)], 1)
    p, q = probs(t_logits, rs), probs(d_logits, rs)  # rs [B] broadcasts over the positions
    assert np.isfinite(np.asarray(p)).all() and np.isfinite(np.asarray(q)).all()
    n, nxt = rejection_sample(keys, drafts, q, p)
    n, nxt = np.asarray(n), np.asarray(nxt)
    assert ((0 <= n) & (n <= k)).all() and ((0 <= nxt) & (nxt < v)).all()
    gn, gnxt = (np.asarray(a) for a in greedy_accept(drafts, t_logits))
    for i in range(b):
        t, kk, tp = EDGE_ROWS[i % len(EDGE_ROWS)]
        if all(_deterministic(t, kk, tp, np.asarray(t_logits[i, j])) for j in range(k + 1)):
            assert (n[i], nxt[i]) == (gn[i], gnxt[i]), (i, EDGE_ROWS[i % len(EDGE_ROWS)])


@pytest.fixture(scope="module")
def target():
    return tiny_model(tiny_config(num_layers=2), scale=4.0)


@pytest.mark.parametrize("name", ["none", "ngram", "draft"])
def test_degenerate_parameters_decode_greedily_through_the_engine(target, name):
    """top-p that float32 rounds to 0, temperatures that overflow the logits or are subnormal,
    top-k 1: each is the argmax, so the engine's output (plain, n-gram and draft-model
    speculation, sampled acceptance) equals greedy decoding token for token."""
    draft = tiny_model(tiny_config(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1), seed=5, scale=4.0)
    drafter, dparams = {"none": (None, None), "ngram": (NgramDrafter(3, 3, 1), None),
                        "draft": (DraftModelDrafter(3, draft.config), draft.params)}[name]
    config = EngineConfig(max_num_seqs=4, max_model_len=64, page_size=8, max_burst_steps=4)
    engine = LLMEngine(target, config, SpecConfig(), drafter=drafter, drafter_params=dparams)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    kws = [dict(), dict(temperature=1.0, top_p=1e-46), dict(temperature=2e-38), dict(temperature=1e-40, top_p=0.5),
           dict(temperature=0.9, top_k=1, seed=2**63 - 1)]
    for i, kw in enumerate(kws):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=10, ignore_eos=True, **kw))
    while engine.has_unfinished_requests():
        engine.step()
    outs = [engine.requests[str(i)].output_ids for i in range(len(kws))]
    assert all(o == outs[0] and len(o) == 10 for o in outs), outs
