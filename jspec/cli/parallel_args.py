"""``--tp`` (``jspec generate`` and ``jspec serve``) and the multi-host flags (``jspec generate``:
the server runs on one host, since only one process would receive its requests).

    --tp N                     shard the target over N devices (jspec.parallel)
    --coordinator-address H:P  with --num-processes and --process-id: jax.distributed across
    --num-processes N          hosts (default: JSPEC_/JAX_COORDINATOR_ADDRESS, _NUM_PROCESSES,
    --process-id I             _PROCESS_ID from the environment; none: one process)
"""

from __future__ import annotations


def add_parallel_arguments(p, multi_host: bool = True) -> None:
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="devices to shard the target over (heads, MLP, vocabulary, KV pages; default 1)")
    if not multi_host:
        return
    p.add_argument("--coordinator-address", default=None,
                   help="multi-host: host:port of process 0 (default $JSPEC_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: processes in all")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")


def check_tp_option(args) -> None:
    """Before anything loads: the value of --tp, and joining the other processes."""
    from jspec.errors import ConfigError
    from jspec.parallel import initialize_distributed

    if args.tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {args.tp}")
    if hasattr(args, "coordinator_address"):
        initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)


def check_tp_fits(args, config) -> None:
    """Once the config is known (before the weights load): heads and devices allow --tp."""
    from jspec.models.tensor_parallel import tp_config
    from jspec.parallel import make_mesh

    if args.tp > 1:
        tp_config(config, args.tp)
        make_mesh(args.tp)
