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
    d.set_defaults(func=cmd_distill)

    e = sub.add_parser("export-draft", help="write a small-llama draft as a full Hugging Face directory")
    e.add_argument("draft", help="draft checkpoint directory")
    e.add_argument("--target", default="smollm2-135m")
    e.add_argument("--out", required=True)
    e.set_defaults(func=cmd_export)


def cmd_distill(args) -> int:
    import jspec
    from jspec.train.distill import DistillConfig, run
    from jspec.train.trainer import TrainConfig

    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                     checkpoint_every=args.checkpoint_every, weight_decay=args.weight_decay, seed=args.seed)
    dc = DistillConfig(arch=args.arch, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                       draft_vocab=args.draft_vocab, draft_layers=args.draft_layers, unroll=args.unroll, train=tc,
                       gen_batch_size=args.gen_batch_size)
    out = Path(args.out)
    if out.exists() and any(p.name != ".train" for p in out.iterdir()) and not args.resume:
        raise jspec.ConfigError(f"{out} already holds a checkpoint; pass --resume or choose another --out")
    target = jspec.load_model(args.target)
    card = run(target, args.target, out, dc, resume=args.resume, eval_prompts=args.eval_prompts)
    print(f"wrote {out} ({card['architecture']}, {card['training']['steps']} steps)")
    return 0


def cmd_export(args) -> int:
    import jspec
    from jspec.loading.drafts import export_hf

    target = jspec.load_model(args.target)
    print(f"wrote {export_hf(Path(args.draft), target, Path(args.out))}")
    return 0
