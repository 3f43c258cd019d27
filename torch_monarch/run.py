"""``python3 -m torch_monarch.run`` (console script ``monarch-run``): torchrun itself.

    python3 -m torch_monarch.run --nproc-per-node 4 train.py --lr 3e-4
    python3 -m torch_monarch.run --nproc-per-node 2 --no-python ./train_gpt      # a C++ binary
    python3 -m torch_monarch.run --nnodes 2 --node-rank 0 --rdzv-backend c10d \\
        --rdzv-endpoint 10.0.0.1:29400 --nproc-per-node 8 train.py               # per node

It is torchrun's elastic agent with torchrun's flags, in both spellings
(``--nproc_per_node`` and ``--nproc-per-node``). On torch >= 2.0 it only delegates to
``torch.distributed.run``. On torch 1.x it adds the dashed spellings and repairs the
redirect parser that breaks torchrun on Python 3.11 (see ``compat.fix_elastic_std_parsing``).
Workers receive torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...
and TORCHELASTIC_USE_AGENT_STORE / TORCHELASTIC_RESTART_COUNT, which ``torch_monarch.init``
and ``monarch::World::init`` honour by joining the agent's store).
"""

import sys


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record

    from . import compat

    if not compat.torchrun_needs_fixes():
        return torchrun.main(argv)

    compat.fix_elastic_std_parsing()
    parser = compat.add_dashed_aliases(torchrun.get_args_parser())
    parser.prog = "python3 -m torch_monarch.run"
    args = parser.parse_args(argv)
    return record(torchrun.run)(args)


if __name__ == "__main__":
    main()
