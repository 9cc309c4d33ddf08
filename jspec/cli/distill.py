"""``jspec distill`` and ``jspec export-draft``: argument parsing only (see jspec.train.distill)."""

from __future__ import annotations

from pathlib import Path


def add_distill_parser(sub) -> None:
    d = sub.add_parser("distill", help="train a draft (small Llama, EAGLE or EAGLE-3 head) for a target")
    d.add_argument("--target", default="smollm2-135m", help="target model name or path")
    d.add_argument("--arch", default="eagle", choices=["small-llama", "eagle", "eagle3", "eagle3-published"],
                   help="eagle3: a head fusing low/middle/high target layers (see --feature-layers); "
                        "eagle3-published: the EAGLE-3 architecture vLLM and SGLang serve (see export-draft)")
    d.add_argument("--out", required=True, help="output directory, e.g. checkpoints/NAME")
    d.add_argument("--prompts", type=int, default=256,
                   help="standard-library signature + docstring prompts the target continues")
    d.add_argument("--chat-prompts", type=int, default=0,
                   help="chat-template requests (write this function / explain this module) the target answers")
    d.add_argument("--general-prompts", type=int, default=0,
                   help="everyday chat-template requests (stories, explanations, comparisons, letters) the target "
                        "answers")
    d.add_argument("--read-code-tokens", type=int, default=0,
                   help="tokens of standard-library source the target reads (teacher-forced, prefill speed)")
    d.add_argument("--read-prose-tokens", type=int, default=0,
                   help="tokens of Python's help() topics and docstrings the target reads")
    d.add_argument("--window", type=int, default=384, help="tokens per read window")
    d.add_argument("--max-new-tokens", type=int, default=128, help="target continuation length per prompt")
    d.add_argument("--steps", type=int, default=1000)
    d.add_argument("--batch-size", type=int, default=8)
    d.add_argument("--learning-rate", type=float, default=1e-3)
    d.add_argument("--draft-vocab", type=int, default=8192, help="tokens the draft's head covers")
    d.add_argument("--draft-layers", type=int, default=2, help="small-llama: decoder layers")
    d.add_argument("--ttt-depth", "--unroll", dest="ttt_depth", type=int, default=2,
                   help="eagle heads: passes of the training-time test (the head trained on its own chain)")
    d.add_argument("--feature-layers", default=None, metavar="I,J,K",
                   help="eagle3: target layers to fuse (default 2, L/2, L-3)")
    d.add_argument("--budget-minutes", type=float, default=None,
                   help="fit data + training + held-out scoring in this many minutes (sets the steps)")
    d.add_argument("--eval-k", type=int, default=8, help="the card's held-out acceptance per position up to this k")
    d.add_argument("--checkpoint-every", type=int, default=100, help="steps between training-state saves "
                   "(and validation: the best-scoring parameters are kept)")
    d.add_argument("--weight-decay", type=float, default=0.01)
    d.add_argument("--gen-batch-size", type=int, default=16, help="prompts per target generation batch")
    d.add_argument("--eval-prompts", type=int, default=10, help="held-out HumanEval prompts to measure (0: skip)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--resume", action="store_true", help="continue from OUT/.train")
    d.add_argument("--init", default=None, metavar="DRAFT",
                   help="start from this draft checkpoint (name or path, same --arch) instead of a fresh draft")
    d.set_defaults(func=cmd_distill)

    e = sub.add_parser("export-draft", help="write a small-llama draft as a full Hugging Face directory, or an "
                                            "EAGLE head in the layout vLLM and SGLang load")
    e.add_argument("draft", help="draft checkpoint directory (jspec's, or a published EAGLE head)")
    e.add_argument("--target", default="smollm2-135m")
    e.add_argument("--out", required=True)
    e.add_argument("--layout", default="eagle", choices=["eagle", "speculators"],
                   help="an EAGLE head's layout: the EAGLE authors' and SpecForge's (midlayer.), or vLLM's "
                        "speculators format (layers.0.)")
    e.set_defaults(func=cmd_export)


def check_numbers(args) -> None:
    """Every number of ``jspec distill``, checked before the target loads."""
    import math

    from jspec.config import INT32_MAX, MAX_SEED, MAX_TOKENS
    from jspec.errors import ConfigError
    from jspec.train.distill import DistillConfig, split_validation

    limits = {"max_new_tokens": MAX_TOKENS, "steps": INT32_MAX, "batch_size": 1 << 16,
              "draft_vocab": INT32_MAX, "draft_layers": 1 << 10, "ttt_depth": 64, "checkpoint_every": INT32_MAX,
              "gen_batch_size": 1 << 16, "eval_k": 64, "window": 1 << 16}
    for name, hi in limits.items():
        v = getattr(args, name)
        if not 1 <= v <= hi:
            raise ConfigError(f"--{name.replace('_', '-')} must be in [1, {hi}], got {v}")
    for name in ("prompts", "chat_prompts", "general_prompts", "read_code_tokens", "read_prose_tokens"):
        v = getattr(args, name)
        if not 0 <= v <= 1 << 30:
            raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 2^30], got {v}")
    if args.prompts + args.chat_prompts + args.general_prompts + args.read_code_tokens + args.read_prose_tokens == 0:
        raise ConfigError("the data mix is empty: give --prompts, --chat-prompts, --general-prompts or --read-*-tokens")
    if args.window < 32:
        raise ConfigError(f"--window must be >= 32, got {args.window}")
    if args.budget_minutes is not None and not (math.isfinite(args.budget_minutes) and args.budget_minutes > 0):
        raise ConfigError(f"--budget-minutes must be a finite number > 0, got {args.budget_minutes}")
    args.feature_layers = parse_layers(args.feature_layers)
    if args.feature_layers is not None and args.arch not in ("eagle3", "eagle3-published"):
        raise ConfigError("--feature-layers is for --arch eagle3 and eagle3-published")
    if not 0 <= args.eval_prompts <= 164:
        raise ConfigError(f"--eval-prompts must be in [0, 164] (HumanEval's problems), got {args.eval_prompts}")
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        raise ConfigError(f"--learning-rate must be a finite number > 0, got {args.learning_rate}")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise ConfigError(f"--weight-decay must be a finite number >= 0, got {args.weight_decay}")
    if not 0 <= args.seed <= MAX_SEED:
        raise ConfigError(f"--seed must be in [0, 2^63), got {args.seed}")
    if args.read_code_tokens + args.read_prose_tokens == 0:  # else the sequence count is known after reading
        n = args.prompts + args.chat_prompts + args.general_prompts
        train_prompts = len(split_validation(n, DistillConfig.validation_fraction, args.seed)[0])
        if args.batch_size > train_prompts:
            raise ConfigError(f"--batch-size {args.batch_size} exceeds the {train_prompts} training prompts "
                              f"(--prompts + --chat-prompts + --general-prompts {n}, less the held-out ones)")


def parse_layers(text):
    """``"2,15,27"`` -> (2, 15, 27); None stays None."""
    from jspec.errors import ConfigError

    if text is None:
        return None
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--feature-layers must be comma-separated layer indices, got {text!r}") from None
    if not layers or len(set(layers)) != len(layers) or min(layers) < 0:
        raise ConfigError(f"--feature-layers must be distinct layer indices >= 0, got {text!r}")
    return layers


def cmd_distill(args) -> int:
    import jspec
    from jspec.loading import open_checkpoint
    from jspec.train.distill import DistillConfig, run
    from jspec.train.trainer import TrainConfig

    check_numbers(args)
    target = open_checkpoint(args.target)  # a missing or broken target fails before anything else

    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                     checkpoint_every=args.checkpoint_every, weight_decay=args.weight_decay, seed=args.seed)
    dc = DistillConfig(arch=args.arch, prompts=args.prompts, chat_prompts=args.chat_prompts,
                       general_prompts=args.general_prompts,
                       read_code_tokens=args.read_code_tokens, read_prose_tokens=args.read_prose_tokens,
                       window=args.window, max_new_tokens=args.max_new_tokens, draft_vocab=args.draft_vocab,
                       draft_layers=args.draft_layers, ttt_depth=args.ttt_depth, feature_layers=args.feature_layers,
                       train=tc, gen_batch_size=args.gen_batch_size, budget_minutes=args.budget_minutes,
                       eval_k=args.eval_k)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise jspec.ConfigError(f"--out {out} is a file, not a directory")
    if out.exists() and any(p.name != ".train" for p in out.iterdir()) and not args.resume:
        raise jspec.ConfigError(f"{out} already holds a checkpoint; pass --resume or choose another --out")
    target = target.load()
    card = run(target, args.target, out, dc, resume=args.resume, eval_prompts=args.eval_prompts, init=args.init)
    print(f"wrote {out} ({card['architecture']}, {card['training']['steps']} steps)")
    return 0


def cmd_export(args) -> int:
    """A small-llama draft to a Hugging Face directory; an EAGLE head (jspec's card, or a published
    layout) to ``--layout``."""
    import jspec
    from jspec.loading.drafts import export_eagle, export_hf, read_card
    from jspec.loading.eagle_formats import published_kind

    draft, out = Path(args.draft), Path(args.out)
    card = read_card(draft) if draft.is_dir() else None
    if card is None and (not draft.is_dir() or published_kind(draft) is None):
        raise jspec.CheckpointNotFoundError(f"{draft}: not a jspec draft directory (no card.json) nor a published "
                                            "EAGLE head (config.json)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise jspec.ConfigError(f"--out {out} already exists and is not an empty directory")
    target = jspec.load_model(args.target)
    if card is not None and card.get("architecture") == "small-llama":
        print(f"wrote {export_hf(draft, target, out)}")
    else:
        print(f"wrote {export_eagle(draft, target, out, args.layout)} ({args.layout} layout)")
    return 0
