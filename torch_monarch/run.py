"""``python3 -m torch_monarch.run``: torchrun, under the name the README has used since torch 1.x.

    python3 -m torch_monarch.run --nproc-per-node 4 train.py --lr 3e-4
    python3 -m torch_monarch.run --nproc-per-node 2 --no-python ./train_gpt      # a C++ binary

On torch 2.x there is nothing left to add to torchrun: this only delegates to
``torch.distributed.run`` with the same arguments, so ``torchrun`` works just as well and is what
the README shows first. Workers receive torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, ... and TORCHELASTIC_USE_AGENT_STORE / TORCHELASTIC_RESTART_COUNT, which
``torch_monarch.init`` and ``monarch::World::init`` honour by joining the agent's store).
"""

import sys


def main(argv=None):
    import torch.distributed.run as torchrun

    return torchrun.main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
