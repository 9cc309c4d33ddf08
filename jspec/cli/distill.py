"""``jspec distill`` and ``jspec export-draft``: argument parsing only (see jspec.train.distill)."""

from __future__ import annotations

from pathlib import Path


def add_distill_parser(sub) -> None:
    d = sub.add_parser("distill", help="train a draft (small Llama or EAGLE head) for a target")
    d.add_argument("--target", default="smollm2-135m", help="target model name or path")
    d.add_argument("--arch", default="eagle", choices=["small-llama", "eagle"])
    d.add_argument("--out", required=True, help="output directory, e.g. checkpoints/NAME")
    d.add_argument("--prompts", type=int, default=256, help="training prompts (standard-library functions)")
    d.add_argument("--max-new-tokens", type=int, default=128, help="target continuation length per prompt")
    d.add_argument("--steps", type=int, default=1000)
    d.add_argument("--batch-size", type=int, default=8)
    d.add_argument("--learning-rate", type=float, default=1e-3)
    d.add_argument("--draft-vocab", type=int, default=8192, help="tokens the draft's head covers")
    d.add_argument("--draft-layers", type=int, default=2, help="small-llama: decoder layers")
    d.add_argument("--unroll", type=int, default=2, help="eagle: training depth on its own predicted features")
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

    e = sub.add_parser("export-draft", help="write a small-llama draft as a full Hugging Face directory")
    e.add_argument("draft", help="draft checkpoint directory")
    e.add_argument("--target", default="smollm2-135m")
    e.add_argument("--out", required=True)
    e.set_defaults(func=cmd_export)


def check_numbers(args) -> None:
    """Every number of ``jspec distill``, checked before the target loads."""
    import math

    from jspec.config import INT32_MAX, MAX_SEED, MAX_TOKENS
    from jspec.errors import ConfigError
    from jspec.train.distill import DistillConfig, split_validation

    limits = {"prompts": 1 << 20, "max_new_tokens": MAX_TOKENS, "steps": INT32_MAX, "batch_size": 1 << 16,
              "draft_vocab": INT32_MAX, "draft_layers": 1 << 10, "unroll": 1 << 10, "checkpoint_every": INT32_MAX,
              "gen_batch_size": 1 << 16}
    for name, hi in limits.items():
        v = getattr(args, name)
        if not 1 <= v <= hi:
            raise ConfigError(f"--{name.replace('_', '-')} must be in [1, {hi}], got {v}")
    if not 0 <= args.eval_prompts <= 164:
        raise ConfigError(f"--eval-prompts must be in [0, 164] (HumanEval's problems), got {args.eval_prompts}")
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        raise ConfigError(f"--learning-rate must be a finite number > 0, got {args.learning_rate}")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise ConfigError(f"--weight-decay must be a finite number >= 0, got {args.weight_decay}")
    if not 0 <= args.seed <= MAX_SEED:
        raise ConfigError(f"--seed must be in [0, 2^63), got {args.seed}")
    train_prompts = len(split_validation(args.prompts, DistillConfig.validation_fraction, args.seed)[0])
    if args.batch_size > train_prompts:
        raise ConfigError(f"--batch-size {args.batch_size} exceeds the {train_prompts} training prompts "
                          f"(--prompts {args.prompts}, less the held-out ones)")


def cmd_distill(args) -> int:
    import jspec
    from jspec.loading import open_checkpoint
    from jspec.train.distill import DistillConfig, run
    from jspec.train.trainer import TrainConfig

    check_numbers(args)
    target = open_checkpoint(args.target)  # a missing or broken target fails before anything else

    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                     checkpoint_every=args.checkpoint_every, weight_decay=args.weight_decay, seed=args.seed)
    dc = DistillConfig(arch=args.arch, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                       draft_vocab=args.draft_vocab, draft_layers=args.draft_layers, unroll=args.unroll, train=tc,
                       gen_batch_size=args.gen_batch_size)
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
    import jspec
    from jspec.loading.drafts import export_hf, read_card

    draft = Path(args.draft)
    if not draft.is_dir() or read_card(draft) is None:
        raise jspec.CheckpointNotFoundError(f"{draft}: not a jspec draft directory (no card.json)")
    target = jspec.load_model(args.target)
    print(f"wrote {export_hf(Path(args.draft), target, Path(args.out))}")
    return 0
