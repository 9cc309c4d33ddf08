"""Training data for drafts: text that is not the benchmark's, and the target's view of it.

Two kinds of sequence, both never HumanEval nor a benchmark prompt:

- **generated**: a prompt and the target's own greedy continuation of it (through the serving
  engine), so the draft learns what *this* target writes. Prompts: function signatures with
  their docstrings from the Python standard library (raw, the shape of a HumanEval prompt), and
  chat-template requests built from the standard library (write this function; explain this
  module or topic), since users run ``--chat``;
- **read** (teacher-forced): windows of existing text the target only reads, in one forward
  pass per batch, at prefill speed: standard-library source code, and prose from Python's own
  documentation (``pydoc_data.topics``, the text of ``help()``) and long docstrings. The
  target's greedy choice at each position is still the label, so the draft learns to predict
  the target on text it did not write (EAGLE-1 trained on fixed ShareGPT text this way).

For each sequence the target's features (its final hidden states, and for EAGLE-3 heads the
residual stream after chosen layers) and its greedy choice at every position are stored, as
float16 (features) and int32. ``prompt_lengths`` marks where generation started: a read window's
prompt length is its length (nothing in it is the target's own).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import random
import sysconfig
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jspec.engine.engine import encode_prompt
from jspec.loading.drafts import load_tensors, save_tensors
from jspec.models.llama import RMSNorm, forward, output_embedding
from jspec.train.objectives import fresh_cache


def _stdlib_files() -> Iterator[tuple[Path, str, ast.Module]]:
    """(path, source, tree) of the standard library's modules, tests and IDLE left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts or path.name.startswith("test") or "idlelib" in path.parts:
            continue
        try:
            src = path.read_text(encoding="utf-8")
            yield path, src, ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue


def _documented_functions(min_doc_chars: int = 60) -> Iterator[tuple[str, str, str]]:
    """(signature + docstring text, function name, docstring) of public stdlib functions."""
    for _, src, tree in _stdlib_files():
        lines = src.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < min_doc_chars or not node.body:
                continue
            first = node.body[0]
            text = "\n".join(lines[node.lineno - 1:first.end_lineno])
            indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
            yield "\n".join(line[indent:] for line in text.splitlines()) + "\n", node.name, doc


def stdlib_prompts(count: int, seed: int = 0, min_doc_chars: int = 60, max_chars: int = 1500) -> list[str]:
    """``count`` prompts ``def name(args):\\n    \"\"\"docstring\"\"\"\\n`` from the standard library."""
    found = [text for text, _, _ in _documented_functions(min_doc_chars) if len(text) <= max_chars]
    random.Random(seed).shuffle(found)
    return found[:count]


def chat_requests(count: int, seed: int = 0, max_chars: int = 1200) -> list[str]:
    """``count`` user messages for the chat template, half code and half prose: "write this
    function" from a stdlib docstring, "explain" a stdlib module (its docstring's subject) or
    a topic of Python's ``help()``."""
    rng = random.Random(seed)
    code = [f"Write a Python function `{name}` that does the following.\n\n{doc}"
            for _, name, doc in _documented_functions(80) if len(doc) <= max_chars]
    prose = []
    for path, _, tree in _stdlib_files():
        doc = ast.get_docstring(tree)
        if doc and len(doc) >= 40:
            name = path.stem if path.name != "__init__.py" else path.parent.name
            first = doc.strip().splitlines()[0]
            prose.append(rng.choice([f"What is the Python module `{name}` for? Its summary: {first}",
                                     f"Explain what `{name}` in Python's standard library does, with an example.",
                                     f"Summarize in a few sentences: {first}"]))
    from pydoc_data.topics import topics

    prose += [f"Explain the Python topic '{t}' in plain words." for t in sorted(topics)]
    rng.shuffle(code)
    rng.shuffle(prose)
    half = count // 2
    out = code[:count - min(half, len(prose))] + prose[:half]
    rng.shuffle(out)
    return out[:count]


# Everyday requests a user of ``--chat`` makes, built from task templates and subjects written for
# this purpose (never a benchmark prompt: tests/test_train.py checks them against
# benchmarks/prose_prompts.jsonl). The target's replies are the data, so what matters is that the
# target answers in its general-assistant voice, on subjects that are not Python.
_STORY_SUBJECTS = (
    "a baker who opens a shop at midnight", "a dog that gets lost in a big city", "two friends on a long train ride",
    "a girl who builds a robot from old radios", "a farmer during the first snow of winter",
    "an astronaut returning home after a year", "a cat that rules a small fishing village",
    "a boy who finds a map in his grandfather's attic", "a musician who loses her voice",
    "a dragon that is afraid of fire", "a mail carrier on the last day before retirement",
    "a family moving to a new country", "a detective who solves cases by smell", "a tree that has watched a town grow",
    "a chef competing in a village fair", "a shy student giving a speech", "an old clock that stops at noon",
    "a pilot lost in a storm", "a teacher's first day at a new school", "a fox and a crow who become friends",
    "a city where it never stops raining", "a knight who would rather be a painter", "a lonely robot on Mars",
    "a grandmother teaching her grandson to fish", "a runaway balloon", "a garden that grows overnight")
_STORY_TASKS = ("Write a short story about {}.", "Tell me a bedtime story about {}.", "Write a poem about {}.",
                "Write the opening paragraph of a novel about {}.", "Write a fable about {}, with a moral at the end.")
_TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "earthquakes", "the seasons", "rainbows", "tides",
    "the immune system", "vaccines", "how the heart pumps blood", "dreams", "memory", "gravity", "magnets",
    "electricity in a home", "solar panels", "wind turbines", "nuclear power", "batteries", "the internet",
    "email", "GPS navigation", "a refrigerator", "an airplane's wings", "a car engine", "a microwave oven",
    "the stock market", "inflation", "interest rates", "supply and demand", "taxes", "insurance", "recycling",
    "composting", "coral reefs", "rain forests", "deserts", "bees and pollination", "bird migration",
    "black holes", "the Moon's phases", "eclipses", "comets", "the Big Bang", "evolution", "DNA", "bacteria",
    "antibiotics", "sleep cycles", "exercise and the body", "nutrition labels", "coffee", "bread baking",
    "fermentation", "democracy", "the United Nations", "the printing press", "the Roman Empire", "ancient Egypt",
    "the Industrial Revolution", "the Renaissance", "the Silk Road", "the invention of the telephone",
    "the first Moon landing", "the Cold War", "the Olympic Games", "jazz music", "impressionist painting",
    "chess", "soccer", "meditation", "public speaking", "learning a language", "saving money", "job interviews",
    "time management", "gardening", "camping", "running a marathon", "raising a puppy", "moving house",
    "writing a resume", "negotiating a salary", "cooking rice", "learning to swim", "keeping houseplants alive")
_TOPIC_TASKS = ("Explain {} in simple terms.", "How does {} work?", "Tell me about {}.",
                "Give me three interesting facts about {}.", "What should a beginner know about {}?",
                "Write a short paragraph about {} for a school newsletter.", "What are common myths about {}?",
                "Give me five tips on {}, with a sentence on each.", "What are the pros and cons of {}?",
                "Give a brief history of {}.", "Describe {} to someone who has never heard of it.")
_PAIRS = (("a virus", "a bacterium"), ("a lake", "a sea"), ("a crocodile", "an alligator"), ("rugby", "soccer"),
          ("a novel", "a short story"), ("a loan", "a gift"), ("a city", "a town"), ("tea", "coffee"),
          ("renting", "buying a home"), ("a violin", "a cello"), ("a comet", "an asteroid"), ("speed", "velocity"),
          ("a hurricane", "a tornado"), ("a monarchy", "a republic"), ("baking", "roasting"), ("a frog", "a toad"),
          ("stocks", "bonds"), ("a debit card", "a credit card"), ("a poem", "a song"), ("a moth", "a butterfly"))
_PAIR_TASKS = ("What is the difference between {} and {}?", "Compare {} and {} in a short paragraph.",
               "When would someone choose {} over {}?")
_WORKS = ("Hamlet", "Macbeth", "Pride and Prejudice", "Moby-Dick", "The Odyssey", "Frankenstein", "Don Quixote",
          "A Christmas Carol", "Alice's Adventures in Wonderland", "Treasure Island", "The Time Machine",
          "Jane Eyre", "Little Women", "Dracula", "Oliver Twist", "Robinson Crusoe", "Gulliver's Travels",
          "The Iliad", "Cinderella", "The Wizard of Oz", "Peter Pan", "Great Expectations", "The Jungle Book")
_WORK_TASKS = ("Summarize {} in a few sentences.", "Who are the main characters of {}?",
               "What is the main theme of {}?", "Why is {} still read today?")
_LETTERS = ("a landlord about a broken heater", "a neighbour about a noisy party", "a friend I have not seen in years",
            "my manager asking for a day off", "a customer apologising for a late delivery",
            "a teacher about my child's homework", "a hotel asking to change a booking",
            "the city council about a dangerous crossing", "a colleague thanking her for her help",
            "a company declining a job offer", "my team announcing a new project", "a shop asking for a refund")
_LETTER_TASKS = ("Write an email to {}.", "Write a short, polite letter to {}.", "Draft a text message to {}.")


def general_requests(count: int, seed: int = 0) -> list[str]:
    """``count`` everyday chat requests (stories, explanations, comparisons, summaries of classic
    books, letters): task templates filled with subjects, drawn evenly from the five kinds."""
    rng = random.Random(seed)
    kinds = [[t.format(s) for t in _STORY_TASKS for s in _STORY_SUBJECTS],
             [t.format(s) for t in _TOPIC_TASKS for s in _TOPICS],
             [t.format(a, b) for t in _PAIR_TASKS for a, b in _PAIRS],
             [t.format(w) for t in _WORK_TASKS for w in _WORKS],
             [t.format(x) for t in _LETTER_TASKS for x in _LETTERS]]
    for k in kinds:
        rng.shuffle(k)
    out, i = [], 0
    while len(out) < count and any(i < len(k) for k in kinds):
        out += [k[i] for k in kinds if i < len(k)]
        i += 1
    out = out[:count]
    rng.shuffle(out)
    return out


def code_documents(seed: int = 0) -> list[str]:
    """Whole standard-library source files (tests and IDLE left out), shuffled."""
    docs = [src for _, src, _ in _stdlib_files() if len(src) >= 200]
    random.Random(seed).shuffle(docs)
    return docs


def prose_documents(seed: int = 0, min_chars: int = 300) -> list[str]:
    """English prose that ships with Python: the topics of ``help()`` (``pydoc_data.topics``, the
    language reference's text), module docstrings and long function/class docstrings."""
    from pydoc_data.topics import topics

    docs = [text for _, text in sorted(topics.items()) if len(text) >= min_chars]
    for _, _, tree in _stdlib_files():
        for node in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]:
            doc = ast.get_docstring(node)
            if doc and len(doc) >= min_chars:
                docs.append(doc)
    random.Random(seed).shuffle(docs)
    return docs


def read_windows(tokenizer, docs: list[str], width: int, max_tokens: int, min_tokens: int = 32) -> list[list[int]]:
    """Consecutive windows of at most ``width`` tokens cut from ``docs`` (in order; never across
    two documents; pieces under ``min_tokens`` dropped) until ``max_tokens`` tokens are taken."""
    out, total = [], 0
    for doc in docs:
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids), width):
            piece = ids[start:start + width]
            if len(piece) < min_tokens:
                continue
            piece = piece[:max_tokens - total]
            out.append(piece)
            total += len(piece)
            if total >= max_tokens:
                return out
    return out


@dataclasses.dataclass
class DraftData:
    """Sequences (prompt + the target's continuation, or a read window) and the target's view."""

    tokens: np.ndarray  # int32 [N, L]
    lengths: np.ndarray  # int32 [N]
    prompt_lengths: np.ndarray  # int32 [N]: generation started here (== lengths: a read window)
    features: Optional[np.ndarray] = None  # float16 [N, L, H]: the target's final hidden states
    argmax: Optional[np.ndarray] = None  # int32 [N, L]: the target's greedy next token after position t
    layer_features: Optional[np.ndarray] = None  # float16 [N, L, len(feature_layers) * H]
    feature_layers: tuple[int, ...] = ()  # the target layers of layer_features
    sources: Optional[np.ndarray] = None  # int8 [N]: each sequence's entry in mix["sources"]
    mix: Optional[dict] = None  # what the sequences are: their sources, counts and the data's speed

    def fingerprint(self) -> str:
        return hashlib.sha256(self.tokens.tobytes() + self.lengths.tobytes()).hexdigest()[:16]

    def save(self, path: Path) -> None:
        import json

        t = {"tokens": self.tokens, "lengths": self.lengths, "prompt_lengths": self.prompt_lengths}
        if self.features is not None:
            t.update(features=self.features, argmax=self.argmax)
        if self.layer_features is not None:
            t["layer_features"] = self.layer_features
        if self.sources is not None:
            t["sources"] = self.sources
        meta = {"feature_layers": json.dumps(list(self.feature_layers)), "mix": json.dumps(self.mix)}
        save_tensors(path, t, meta)

    @classmethod
    def load(cls, path: Path) -> "DraftData":
        import json

        from safetensors import safe_open

        t = load_tensors(path)
        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
        return cls(t["tokens"], t["lengths"], t["prompt_lengths"], t.get("features"), t.get("argmax"),
                   t.get("layer_features"), tuple(json.loads(meta.get("feature_layers", "[]"))),
                   t.get("sources"), json.loads(meta.get("mix", "null")))

    @property
    def generated(self) -> np.ndarray:
        """bool [N]: sequences that hold a continuation the target wrote."""
        return self.prompt_lengths < self.lengths


def from_sequences(seqs: list[list[int]], prompt_lengths: list[int]) -> DraftData:
    width = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
    return DraftData(tokens, np.asarray([len(s) for s in seqs], np.int32), np.asarray(prompt_lengths, np.int32))


def concat(parts: list[DraftData]) -> DraftData:
    """One DraftData of several (tokens only; features are added afterwards)."""
    seqs = [list(p.tokens[i, :p.lengths[i]]) for p in parts for i in range(len(p.lengths))]
    return from_sequences(seqs, [int(x) for p in parts for x in p.prompt_lengths])


def generate_sequences(target, prompts: list, max_new_tokens: int, batch_size: int = 16,
                       progress: Optional[Callable[[int], None]] = None, static: bool = False,
                       chat: bool = False) -> DraftData:
    """Greedy continuations of ``prompts`` (text, or token ids) by the target (EOS respected);
    ``chat`` puts each text prompt in the target's chat template first.

    Through the serving engine: ``batch_size`` sequences decode together, and the moment one
    finishes its slot takes the next prompt (continuous batching: no sequence waits for the
    slowest of a batch, no padding to the longest). ``static=True`` runs the old way, static
    batches of ``batch_size`` prompts of similar length through ``generate`` (kept to measure the
    difference, ``benchmarks/bench_datagen.py``). Both give the same tokens: greedy decoding in
    the engine does not depend on what else runs beside a sequence."""
    from jspec.config import EngineConfig, SamplingParams
    from jspec.engine.engine import LLMEngine
    from jspec.engine.generate import generate, release_engine
    from jspec.engine.layout import batched_tokens, fit_max_model_len

    ids = [encode_prompt(target.tokenizer, p, chat) for p in prompts]
    sp = SamplingParams(max_tokens=max_new_tokens)
    seqs: dict[int, list[int]] = {}
    if static:
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            out = generate(target, [ids[i] for i in batch], sp)
            for i, new in zip(batch, out.token_ids):
                seqs[i] = ids[i] + new
            if progress:
                progress(len(batch))
        release_engine()  # its pages are not needed for what follows (training)
    else:
        max_len = fit_max_model_len(max(map(len, ids)) + max_new_tokens, target.config.max_position_embeddings)
        # max_len tokens of pages a slot, a little under full_pool_tokens (a slot at full length
        # also holds its last step's rows): slots near their end may wait or be preempted, which
        # changes no greedy token
        engine = LLMEngine(target, EngineConfig(max_num_seqs=batch_size,
                                                max_num_batched_tokens=batched_tokens(batch_size, 0, 512),
                                                max_model_len=max_len, kv_cache_tokens=batch_size * max_len,
                                                max_burst_steps=16, enable_prefix_caching=False))
        reqs = [engine.add_request(str(i), x, sp) for i, x in enumerate(ids)]
        for outs in engine.step_until_done():
            done = sum(out.finished for out in outs)
            if progress and done:
                progress(done)
        seqs = {i: ids[i] + list(r.output_ids) for i, r in enumerate(reqs)}
    return from_sequences([seqs[i] for i in range(len(ids))], [len(x) for x in ids])


def add_target_features(target, data: DraftData, batch_size: int = 8, feature_layers: tuple[int, ...] = (),
                        progress: Optional[Callable[[int], None]] = None) -> DraftData:
    """Run the target over every sequence once: its final hidden state and greedy choice at
    each position (exactly what a verification pass computes there), and with
    ``feature_layers`` the residual stream after those layers (what an EAGLE-3 head reads).
    Sequences run in batches of similar length, each padded to a multiple of 64 tokens."""
    cfg = target.config
    n, width = data.tokens.shape
    h = cfg.hidden_size
    rows = output_embedding(target.params, cfg)

    feature_layers = tuple(feature_layers)
    last = cfg.num_layers - 1
    asked = feature_layers if last in feature_layers else feature_layers + (last,)

    @jax.jit
    def run(params, tokens, lengths):
        b, t = tokens.shape
        out = forward(params, cfg, tokens, fresh_cache(cfg, cfg.num_layers, b, t), lengths, attention="reference",
                      compute_logits=False, feature_layers=asked)
        feats = out.hidden.reshape(b, t, len(asked), h)
        # the residual after the last layer, through the final norm: the final hidden state
        final = RMSNorm(cfg.rms_norm_eps, jnp.dtype(cfg.dtype)).apply({"params": params["norm"]},
                                                                      feats[:, :, asked.index(last)])
        best = jnp.argmax(jnp.einsum("bth,vh->btv", final, rows), -1).astype(jnp.int32)
        layered = feats[:, :, :len(feature_layers)].reshape(b, t, -1)
        return final.astype(jnp.float16), layered.astype(jnp.float16), best

    final = np.zeros((n, width, h), np.float16)
    layers = np.zeros((n, width, h * len(feature_layers)), np.float16) if feature_layers else None
    best = np.zeros((n, width), np.int32)
    order = np.argsort(data.lengths, kind="stable")
    for s in range(0, n, batch_size):
        idx = order[s:s + batch_size]
        w = min(width, -(-int(data.lengths[idx].max()) // 64) * 64)
        tok = np.zeros((batch_size, w), np.int32)
        lens = np.zeros((batch_size,), np.int32)
        tok[:len(idx)], lens[:len(idx)] = data.tokens[idx, :w], data.lengths[idx]
        f, l, a = run(target.params, jnp.asarray(tok), jnp.asarray(lens))
        final[idx, :w], best[idx, :w] = np.asarray(f[:len(idx)]), np.asarray(a[:len(idx)])
        if layers is not None:
            layers[idx, :w] = np.asarray(l[:len(idx)])
        if progress:
            progress(len(idx))
    return dataclasses.replace(data, features=final, argmax=best, layer_features=layers,
                               feature_layers=tuple(feature_layers))


def _timed(fn):
    t = time.time()
    out = fn()
    return out, time.time() - t


@dataclasses.dataclass(frozen=True)
class DataMix:
    """What a draft trains on (counts of sequences the target writes, tokens of text it reads)."""

    prompts: int = 256  # standard-library signature + docstring prompts, raw, with continuations
    chat_prompts: int = 0  # chat-template requests built from the standard library, with replies
    general_prompts: int = 0  # everyday chat-template requests (stories, explanations, letters), with replies
    read_code_tokens: int = 0  # standard-library source, read
    read_prose_tokens: int = 0  # Python's help() topics and long docstrings, read
    window: int = 384  # tokens per read window
    max_prompt_tokens: int = 256
    max_new_tokens: int = 128
    gen_batch_size: int = 16  # engine slots while generating
    seed: int = 0


def build_data(target, mix: DataMix, layers: tuple[int, ...], path: Path, reuse: bool, say=print) -> DraftData:
    """The sequences of ``mix`` with the target's features (``layers``: the residual layers an
    EAGLE-3 head reads), saved to ``path``; with ``reuse`` loaded from there instead (its layer
    features sliced, or recomputed if it holds others)."""
    from tqdm import tqdm  # text bar everywhere: no ipywidgets needed in notebooks

    if reuse and path.exists():
        say(f"reusing training data {path}")
        data = DraftData.load(path)
        if layers and set(layers) <= set(data.feature_layers):  # a subset of the layers held: slice
            h = target.config.hidden_size
            cols = np.concatenate([np.arange(h) + h * data.feature_layers.index(i) for i in layers])
            if tuple(layers) != data.feature_layers:
                data = dataclasses.replace(data, layer_features=data.layer_features[..., cols], feature_layers=layers)
        elif layers and data.feature_layers != layers:
            say(f"it holds features of layers {list(data.feature_layers)}, this run reads {list(layers)}: recomputing")
            with tqdm(total=len(data.lengths), desc="target features", unit="seq", dynamic_ncols=True) as bar:
                data = dataclasses.replace(add_target_features(target, data, feature_layers=layers,
                                                               progress=bar.update), mix=data.mix)
            data.save(path)
        return data
    tok = target.tokenizer
    parts, sources = [], []

    def fits(prompt, chat):
        return len(encode_prompt(tok, prompt, chat)) <= mix.max_prompt_tokens

    gen_tokens, gen_s = 0, 0.0
    for name, count, chat, pick in (
            ("stdlib signature + docstring, raw, target continuation", mix.prompts, False, stdlib_prompts),
            ("chat request from the stdlib (write this function / explain this module or topic), target reply",
             mix.chat_prompts, True, chat_requests),
            ("everyday chat request (story, explanation, comparison, summary, letter), target reply",
             mix.general_prompts, True, general_requests)):
        if not count:
            continue
        prompts = [p for p in pick(count * 2, seed=mix.seed) if fits(p, chat)][:count]
        with tqdm(total=len(prompts), desc="target continuations" + (" (chat)" if chat else ""), unit="prompt",
                  dynamic_ncols=True) as bar:
            part, sec = _timed(lambda: generate_sequences(target, prompts, mix.max_new_tokens, mix.gen_batch_size,
                                                          bar.update, chat=chat))
        new = int((part.lengths - part.prompt_lengths).sum())
        gen_tokens, gen_s = gen_tokens + new, gen_s + sec
        parts.append(part)
        sources.append({"name": name, "sequences": len(prompts), "tokens": int(part.lengths.sum()),
                        "target_tokens": new, "seconds": round(sec, 1)})
    for name, count, docs in (("stdlib source code, read", mix.read_code_tokens, code_documents),
                              ("Python help() topics and long docstrings (prose), read", mix.read_prose_tokens,
                               prose_documents)):
        if not count:
            continue
        windows = read_windows(tok, docs(mix.seed), mix.window, count)
        if windows:
            parts.append(from_sequences(windows, [len(w) for w in windows]))
            sources.append({"name": name, "sequences": len(windows), "tokens": sum(map(len, windows))})
    data = concat(parts)
    data = dataclasses.replace(data, sources=np.concatenate([np.full(len(p.lengths), i, np.int8)
                                                               for i, p in enumerate(parts)]))
    with tqdm(total=len(data.lengths), desc="target features", unit="seq", dynamic_ncols=True) as bar:
        data, sec = _timed(lambda: add_target_features(target, data, feature_layers=layers, progress=bar.update))
    mix = {"sources": sources, "target_pass_tokens_per_second": round(float(data.lengths.sum()) / sec, 1),
           "generation_tokens_per_second": round(gen_tokens / gen_s, 1) if gen_s else None}
    data = dataclasses.replace(data, mix=mix)
    data.save(path)
    return data


def draft_vocabulary(data: DraftData, size: int, always: tuple[int, ...] = ()) -> np.ndarray:
    """The ``size`` tokens the target chooses most often in ``data`` (plus ``always``), sorted."""
    mask = np.arange(data.tokens.shape[1])[None, :] < data.lengths[:, None]
    counts = np.bincount(data.argmax[mask].ravel(), minlength=1)
    top = list(np.argsort(-counts, kind="stable")[:size])
    ids = sorted(set(int(t) for t in top if counts[t] > 0) | set(always))
    return np.asarray(ids[:max(size, len(always))], np.int32)
