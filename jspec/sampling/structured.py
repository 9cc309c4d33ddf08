"""Structured output: token masks from a JSON schema, a regex, a choice or a grammar.

The grammar engine is llguidance (a maintained Rust library with a wheel and no dependencies:
it installs the same on the CPU and beside the GPU plugins; xgrammar, the other choice, pulls
an unpinned torch and triton). Everything it touches sits behind two classes:

- :class:`GrammarCompiler`, one per tokenizer: turns a
  :class:`~jspec.config.StructuredOutputsParams` into llguidance's grammar, checked against the
  tokenizer (an invalid schema, regex or grammar is a :class:`~jspec.errors.ConfigError` of one
  line, raised when the request is queued) and cached, so a schema compiles once.
- :class:`ConstraintTable`, one per engine: the matchers of the live constrained requests, and
  the function the decode steps call through ``jax.pure_callback`` to get, for every slot, the
  masks of the k + 1 positions a verification scores and how many of the slot's drafts the
  grammar allows.

**How a step uses it** (:mod:`jspec.speculative.steps`): after drafting, one callback per step
hands the host each slot's handle (``DecodeState.constraint``, -1 for none), its committed
length, its last committed tokens and its drafts. The host first brings the slot's matcher up
to the committed tokens (the previous step's commits: the callback needs no other message
from the engine, and calling it twice with the same arguments gives the same answer), then
walks the drafts: the mask at the root, consume d_1, the mask after it, ... and stops at the
first draft the grammar refuses (the drafts are cut there: no verification row is spent on a
token that cannot be accepted). Where the drafter's drafts end (or where they were cut, for a
drafter whose state follows the committed tokens rather than its own drafts: n-gram lookup,
the EAGLE heads, the hybrid), the tokens the grammar forces fill the remaining draft positions
(jump-forward: a JSON schema's keys and punctuation). Then it rolls the drafts back. The step sets every refused
token's target logit to -inf before acceptance, at every verified row, so the accepted tokens
and the extra token follow the constrained target exactly as constrained decoding without
speculation would (greedy and sampled; a sampled drafter's q is conditioned on the mask too).

A slot whose grammar has nowhere to go (a matcher error) gets a mask that allows only EOS, so
the request ends (finish reason ``"stop"``, stop reason ``"grammar: <why>"``) rather than
running on unconstrained.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import StructuredOutputsParams
from jspec.errors import ConfigError

NO_CONSTRAINT = -1  # DecodeState.constraint of a slot without one


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise ConfigError(f"structured output needs the llguidance package ({e})") from None
    return llguidance


def _one_line(message: str) -> str:
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    return " ".join(lines[:3])[:300] if lines else "invalid"


class GrammarCompiler:
    """llguidance grammars for one tokenizer and vocabulary (the model's: rows past the
    tokenizer's vocabulary are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        llg = _llguidance()
        self.vocab_size = int(vocab_size)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        try:
            self.tokenizer = llg.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size,
                                                   eos_token=list(self.eos_ids) or None)
        except Exception as e:
            raise ConfigError(f"structured output cannot use this model's tokenizer: {_one_line(e)}") from None
        self._lock = threading.Lock()

    @functools.lru_cache(maxsize=256)
    def grammar(self, spec: StructuredOutputsParams) -> str:
        """The grammar text of ``spec``, checked against the tokenizer (ConfigError if it does
        not compile, or if it admits no text at all)."""
        llg = _llguidance()
        M = llg.LLMatcher
        try:
            if spec.json is not None:
                grammar = M.grammar_from_json_schema(spec.json, defaults={"whitespace_flexible": False})
            elif spec.json_object:
                grammar = M.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_flexible": False})
            elif spec.regex is not None:
                grammar = M.grammar_from_regex(spec.regex)
            elif spec.choice is not None:
                grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
            else:
                grammar = llg.grammar_from("grammar", spec.grammar)
        except Exception as e:
            raise ConfigError(f"structured output {spec.kind} is invalid: {_one_line(e)}") from None
        is_error, messages = M.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ConfigError(f"structured output {spec.kind} is invalid: {_one_line(messages[0])}")
        probe = self._new_matcher(grammar)
        if probe.is_error():
            raise ConfigError(f"structured output {spec.kind} is invalid: {_one_line(probe.get_error())}")
        mask = np.zeros((self.words,), np.int32)
        probe.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if probe.is_error() or not mask.any():
            raise ConfigError(f"structured output {spec.kind} admits no text")
        return grammar

    @property
    def words(self) -> int:
        """int32 words of one token mask (bit v of word v // 32: token v allowed)."""
        return (self.vocab_size + 31) // 32

    def _new_matcher(self, grammar: str):
        return _llguidance().LLMatcher(self.tokenizer, grammar, log_level=0)

    def matcher(self, spec: StructuredOutputsParams):
        return self._new_matcher(self.grammar(spec))


@dataclasses.dataclass
class _Entry:
    """One constrained request: its matcher and how many of its output tokens it has taken."""

    matcher: object
    prompt_len: int
    consumed: int = 0
    dead: Optional[str] = None  # why the grammar has nowhere to go, once it has not
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


@dataclasses.dataclass(eq=False)  # hashed by identity: the steps hold it as a static field
class ConstraintTable:
    """The engine's constrained requests, by handle. ``window``: the committed tokens a callback
    sees (more than any one step commits: the largest k + 1)."""

    compiler: GrammarCompiler
    window: int

    def __post_init__(self):
        self._entries: dict[int, _Entry] = {}
        self._next = 0
        self._lock = threading.Lock()

    @property
    def words(self) -> int:
        return self.compiler.words

    def register(self, spec: StructuredOutputsParams, prompt_len: int) -> int:
        """A handle for a request with ``spec`` whose output starts after ``prompt_len`` tokens."""
        entry = _Entry(self.compiler.matcher(spec), int(prompt_len))
        with self._lock:
            handle, self._next = self._next, (self._next + 1) % (2**31 - 1)
            self._entries[handle] = entry
        return handle

    def release(self, handle: int) -> None:
        with self._lock:
            self._entries.pop(handle, None)

    def dead_end(self, handle: int) -> Optional[str]:
        e = self._entries.get(handle)
        return None if e is None else e.dead

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ device side

    def device_masks(self, state, drafts: jax.Array, num: jax.Array, limit: jax.Array, replace: bool):
        """For the slots of ``state`` (a :class:`~jspec.speculative.state.DecodeState`) and their
        drafts [B, k] (``num`` [B] real ones): (masks int32 [B, k + 1, words], drafts [B, k],
        forced bool [B, k], count int32 [B]). ``count``: the drafts to verify, the drafter's while
        the grammar allows them, then the grammar's forced tokens (jump-forward: ``forced`` marks
        them) up to ``limit`` [B] drafts, from where the drafter's end, or (``replace``: a drafter
        whose state follows the committed tokens, not its own drafts) from the first one the grammar refuses.
        Unconstrained slots keep their drafts and get every bit set."""
        b, k = drafts.shape
        length = state.tokens.shape[1]
        idx = state.seq_lens[:, None] - self.window + jnp.arange(self.window, dtype=jnp.int32)[None, :]
        window = jnp.take_along_axis(state.tokens, jnp.clip(idx, 0, length - 1), axis=1)
        shapes = (jax.ShapeDtypeStruct((b, k + 1, self.words), jnp.int32), jax.ShapeDtypeStruct((b, k), jnp.int32),
                  jax.ShapeDtypeStruct((b, k), jnp.bool_), jax.ShapeDtypeStruct((b,), jnp.int32))
        host = functools.partial(self._host_masks, replace=replace)
        return jax.pure_callback(host, shapes, state.constraint, state.seq_lens, window, drafts.astype(jnp.int32),
                                 num.astype(jnp.int32), limit.astype(jnp.int32), vmap_method="sequential")

    def _host_masks(self, handles, seq_lens, window, drafts, num, limit, replace: bool):
        handles, seq_lens, window, num, limit = map(np.asarray, (handles, seq_lens, window, num, limit))
        drafts = np.array(drafts, np.int32)  # a copy: forced tokens are written into it
        b, k = drafts.shape
        masks = np.full((b, k + 1, self.words), -1, np.int32)
        forced = np.zeros((b, k), bool)
        count = np.minimum(num, limit).astype(np.int32)
        for row in np.flatnonzero(handles != NO_CONSTRAINT):
            entry = self._entries.get(int(handles[row]))
            if entry is None:  # released: the slot no longer runs
                continue
            with entry.lock:
                self._catch_up(entry, int(seq_lens[row]), window[row])
                count[row] = self._fill(entry, masks[row], drafts[row], forced[row], int(count[row]),
                                        int(limit[row]), replace)
        return masks, drafts, forced, count

    def _catch_up(self, e: _Entry, seq_len: int, window: np.ndarray) -> None:
        """Feed the matcher the tokens committed since it last saw the slot."""
        delta = seq_len - e.prompt_len - e.consumed
        if delta == 0 or e.dead:
            return
        m = e.matcher
        if delta < 0:  # the slot is behind what the matcher took (a recomputed request)
            ok = m.rollback(-delta)
        elif delta > len(window):
            ok, e.dead = False, f"{delta} tokens were committed unseen"
        else:  # an EOS ends the request (or, with ignore_eos, is not text): the grammar does not take it
            new = [int(t) for t in window[len(window) - delta:] if int(t) not in self.compiler.eos_ids]
            ok = m.consume_tokens(new) if new else True
        e.consumed += delta
        if not ok and e.dead is None:
            e.dead = m.get_error() or "the committed tokens left the grammar"

    def _fill(self, e: _Entry, out: np.ndarray, drafts: np.ndarray, forced: np.ndarray, num: int, limit: int,
              replace: bool) -> int:
        """Masks of the root and of each draft kept into ``out`` [k + 1, words]; jump-forward
        tokens written into ``drafts`` / ``forced``. Returns the number of drafts kept."""
        m = e.matcher
        if e.dead is None and m.is_error():
            e.dead = m.get_error() or "the grammar failed"
        if e.dead is not None:
            self._only_eos(out)
            return 0
        eos = self.compiler.eos_ids
        j = consumed = 0
        ended = False  # an EOS was kept: nothing after it is verified

        def mask_at(j: int) -> bool:
            row = out[j]
            m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            return not m.is_error() and bool(row.any())

        if not mask_at(0):
            e.dead = m.get_error() or "the grammar allows no next token"
            self._only_eos(out)
            return 0
        while j < num:  # the drafter's drafts, while the grammar takes them
            tok = int(drafts[j])
            if not (out[j, tok >> 5] >> (tok & 31)) & 1:
                break
            j += 1
            if tok in eos:
                ended = True
                break
            if not m.consume_token(tok):  # pragma: no cover - the mask allowed it
                j -= 1
                break
            consumed += 1
            if not mask_at(j):
                break
        if not ended and j < limit and (j == num or replace) and not m.is_stopped():
            for tok in m.compute_ff_tokens()[:limit - j]:  # jump-forward: the tokens the grammar forces
                if not m.consume_token(tok):
                    break
                drafts[j], forced[j] = tok, True
                j += 1
                consumed += 1
                if not mask_at(j):
                    break
        if consumed:
            m.rollback(consumed)
        return j

    def _only_eos(self, out: np.ndarray) -> None:
        out[:] = 0
        for t in self.compiler.eos_ids:
            bit = 1 << (t & 31)
            out[:, t >> 5] |= np.int32(bit - (1 << 32) if bit >= 1 << 31 else bit)


__all__ = ["GrammarCompiler", "ConstraintTable", "NO_CONSTRAINT"]
