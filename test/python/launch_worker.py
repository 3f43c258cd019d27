"""A training script as users write it, started by test_launcher.py through the launcher:
joins the world with torch_monarch.init() and all-reduces its rank over a mesh."""

import os
import sys

import torch

import torch_monarch


def main(mode):
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if mode == "fail_first_attempt" and attempt == 0 and os.environ["RANK"] == "1":
        sys.exit(7)  # the agent restarts the whole worker group
    world = torch_monarch.init(timeout=60)
    mesh = torch_monarch.device_mesh()
    t = torch.tensor([float(world.rank + 1)])
    mesh.group("dp").all_reduce(t).wait()
    with open(os.path.join(os.environ["MONARCH_TEST_OUTPUT"], f"rank{world.rank}.txt"), "w") as f:
        f.write(f"{world.rank} {world.size} {t.item()} {attempt} {os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "plain"))
