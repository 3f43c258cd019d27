"""Worker ranks for the Python runtime tests (started by dist_harness.launch)."""

import math
import os
import sys

import torch
import torch.distributed as dist

import torch_monarch
from tiny_gpt import GLOBAL_BATCH, STEPS, batch, loss_fn, make_model, make_optimizer


def out_path():
    return os.path.join(os.environ["MONARCH_TEST_OUTPUT"], f"rank{os.environ['RANK']}.pt")


def global_mean(mesh, value):
    t = torch.tensor([value], dtype=torch.float64)
    mesh.group("dp").all_reduce(t, average=True).wait()
    return t.item()


def train_dp(mesh, accumulation=1, compression=None, die_at=None, reduction="flat", inter_node_compression=None):
    dp = mesh.group("dp")
    model = torch_monarch.DataParallel(make_model(seed=1234 + dp.rank), mesh=mesh,
                                       bucket_cap_mb=16 / 1024, gradient_compression=compression,
                                       reduction=reduction, inter_node_compression=inter_node_compression)
    opt = make_optimizer(model.named_parameters())  # an ordinary torch.optim optimizer
    local = GLOBAL_BATCH // dp.size
    micro = local // accumulation
    losses = []
    for step in range(STEPS):
        inputs, targets = batch(step, GLOBAL_BATCH)
        opt.zero_grad()
        total = 0.0
        for k in range(accumulation):
            begin = dp.rank * local + k * micro
            x, y = inputs[begin:begin + micro], targets[begin:begin + micro]
            if k < accumulation - 1:
                with model.no_sync():
                    loss = loss_fn(model(x), y) / accumulation
                    loss.backward()
            else:
                loss = loss_fn(model(x), y) / accumulation
                loss.backward()
            total += loss.item()
        opt.step()
        losses.append(global_mean(mesh, total))
        if die_at is not None and step + 1 == die_at and dp.rank == 1:
            print(f"rank {dp.rank}: dying on purpose", file=sys.stderr, flush=True)
            os._exit(3)
    return {"losses": losses, "state": model.state_dict(),
            "bytes": dp.bytes_sent(torch_monarch._runtime.CollectiveKind.all_reduce)}


def train_sharded(mesh, stage, mixed_precision=None, **options):
    dp = mesh.group("dp")
    plain = make_model(seed=1234 + dp.rank)
    model = torch_monarch.fully_shard(plain, mesh=mesh, zero_stage=stage, mixed_precision=mixed_precision, **options)
    opt = make_optimizer(model.named_parameters())  # steps on this rank's shards
    local = GLOBAL_BATCH // dp.size
    losses = []
    for step in range(STEPS):
        inputs, targets = batch(step, GLOBAL_BATCH)
        opt.zero_grad()
        begin = dp.rank * local
        loss = loss_fn(model(inputs[begin:begin + local]), targets[begin:begin + local])
        loss.backward()
        opt.step()
        losses.append(global_mean(mesh, loss.item()))
    node_bytes = {}
    if options.get("reduction") == "hierarchical":  # what the training steps sent, per link level
        intra, inter = mesh.node_groups("dp")
        node_bytes = {"intra_bytes": intra.total_bytes_sent(), "inter_bytes": inter.total_bytes_sent()}
    shards = list(model.parameters())
    facts = {
        "shard": sum(s.numel() for s in shards),
        "shard_grad": sum(s.grad.numel() for s in shards if s.grad is not None),
        "optimizer_state": sum(opt.state[s]["exp_avg"].numel() for s in shards),
        "held": sum(p.numel() for p in plain.parameters()),
        "held_grad": sum(p.grad.numel() for p in plain.parameters() if p.grad is not None),
        "reduce_bytes": dp.bytes_sent(torch_monarch._runtime.CollectiveKind.reduce_scatter),
        "overlap": model._engine.overlap,
    }
    shape = make_model()
    # This rank's rows of every parameter: dim 0 split in chunks of ceil(rows / N).
    expected = 0
    for p in shape.parameters():
        rows = p.shape[0] if p.dim() else 1
        chunk = math.ceil(rows / dp.size)
        expected += min(max(rows - dp.rank * chunk, 0), chunk) * (p.numel() // max(rows, 1))
    facts["expected"] = expected
    facts["total"] = sum(p.numel() for p in shape.parameters())
    # Sharded state dict round trip: save, train one more step, load, compare.
    saved = model.sharded_state_dict()
    before = [s.detach().clone() for s in shards]
    for s in shards:
        s.grad = torch.ones_like(s)
    opt.step()
    model.load_sharded_state_dict(saved)
    facts["sharded_reload_diff"] = max((s.detach() - b).abs().max().item() for s, b in zip(shards, before))
    state = model.state_dict()
    # Whole-model round trip: load another model's full state dict, then this one back.
    model.load_state_dict(make_model(seed=99).state_dict())
    facts["other_model_loaded"] = any(not torch.equal(s.detach(), b) for s, b in zip(shards, before))
    model.load_state_dict(state)
    facts["full_reload_diff"] = max((s.detach() - b).abs().max().item() for s, b in zip(shards, before))
    # The full state dict loads into the plain model and computes the same logits.
    fresh = make_model(seed=99)
    fresh.load_state_dict(state)
    probe, _ = batch(1000, GLOBAL_BATCH)
    with torch.no_grad():
        facts["logits_diff"] = (model(probe) - fresh(probe)).abs().max().item()
    return {"losses": losses, "state": state, "facts": facts, **node_bytes}


def train_after_failed_backward(mesh, stage):
    """Step 2's first backward raises on every rank (a user's hook on block 0's output, so
    the later blocks' gradients have arrived and some reductions started); the loop catches
    it, zeroes the gradients and redoes the step. The engine must recover: training equals
    the reference's."""
    dp = mesh.group("dp")
    plain = make_model(seed=1234 + dp.rank)
    if stage == 0:
        model = torch_monarch.DataParallel(plain, mesh=mesh, bucket_cap_mb=16 / 1024)
    else:
        model = torch_monarch.fully_shard(plain, mesh=mesh, zero_stage=stage)
    fail = {"now": False}

    def raise_in_backward(_module, _inputs, output):
        def hook(grad):
            if fail["now"]:
                fail["now"] = False
                raise RuntimeError("injected failure in backward")
            return grad
        output.register_hook(hook)
    plain.blocks[0].register_forward_hook(raise_in_backward)
    opt = make_optimizer(model.named_parameters())
    local = GLOBAL_BATCH // dp.size
    losses, failures = [], []
    for step in range(STEPS):
        inputs, targets = batch(step, GLOBAL_BATCH)
        x, y = inputs[dp.rank * local:(dp.rank + 1) * local], targets[dp.rank * local:(dp.rank + 1) * local]
        for attempt in range(2):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            fail["now"] = step == 2 and attempt == 0
            try:
                loss.backward()
            except RuntimeError as e:
                failures.append(str(e).splitlines()[0])
                continue
            break
        opt.step()
        losses.append(global_mean(mesh, loss.item()))
    return {"losses": losses, "state": model.state_dict(), "failures": failures}


def retry_after_dead_peer(mesh, stage):
    """Rank 1 dies before step 1's backward; rank 0's backward fails naming the collective.
    Rank 0 then tries again, twice: each later call must fail at once with that first error
    (not a misleading later one, not a hang)."""
    import time
    dp = mesh.group("dp")
    plain = make_model(seed=1234)
    model = (torch_monarch.DataParallel(plain, mesh=mesh) if stage == 0
             else torch_monarch.fully_shard(plain, mesh=mesh, zero_stage=stage))
    inputs, targets = batch(0, GLOBAL_BATCH)
    loss_fn(model(inputs[:2]), targets[:2]).backward()  # one good step together
    if dp.rank == 1:
        os._exit(3)
    errors, seconds = [], []
    for _ in range(3):
        start = time.monotonic()
        try:
            model.zero_grad()
            loss_fn(model(inputs[:2]), targets[:2]).backward()
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
        seconds.append(time.monotonic() - start)
    return {"errors": errors, "seconds": seconds}


def main(scenario):
    torch.set_num_threads(1)
    if scenario == "dp_on_torch_distributed":
        # torch.distributed first: torch_monarch must reuse its store (no second port).
        dist.init_process_group("gloo")
    world = torch_monarch.init(timeout=float(os.environ.get("MONARCH_TIMEOUT_S", "120")))
    if scenario == "mesh_too_big":
        torch_monarch.device_mesh(dp=world.size + 1)
        return 0
    if scenario == "mesh_disagree":  # rank 0 asks for data parallelism, the others for tp
        torch_monarch.device_mesh(dp=world.size) if world.rank == 0 else torch_monarch.device_mesh(tp=world.size)
        return 0
    mesh = torch_monarch.device_mesh()
    if scenario in ("dp", "dp_on_torch_distributed"):
        result = train_dp(mesh, die_at=int(os.environ.get("MONARCH_TEST_DIE_AT_STEP", "0")) or None)
    elif scenario == "dp_accumulate":
        result = train_dp(mesh, accumulation=2)
    elif scenario == "dp_bf16":
        result = train_dp(mesh, compression="bf16")
    elif scenario.startswith("dp_hier_"):  # dp_hier_none / _bf16 / _int8, nodes from LOCAL_WORLD_SIZE
        result = train_dp(mesh, reduction="hierarchical", inter_node_compression=scenario[len("dp_hier_"):])
        intra, inter = mesh.node_groups("dp")
        result.update(intra_bytes=intra.total_bytes_sent(), inter_bytes=inter.total_bytes_sent(),
                      ranks_per_node=mesh.ranks_per_node)
    elif scenario.startswith("zero3_hier_"):  # ZeRO++: zero3_hier_none / _int8, nodes from LOCAL_WORLD_SIZE
        result = train_sharded(mesh, 3, reduction="hierarchical", inter_node_compression=scenario[len("zero3_hier_"):])
        result.update(ranks_per_node=mesh.ranks_per_node)
    elif scenario == "zero3_bf16":
        result = train_sharded(mesh, 3, mixed_precision=torch.bfloat16)
    elif scenario.startswith("zero"):  # zero<stage>, zero<stage>_overlap, zero<stage>_waited
        overlap = {"_overlap": True, "_waited": False}.get(scenario[5:])
        result = train_sharded(mesh, int(scenario[4]), overlap=overlap)
    elif scenario.startswith("recover_backward"):  # recover_backward0 (dp), 1-3 (ZeRO)
        result = train_after_failed_backward(mesh, int(scenario[-1]))
    elif scenario.startswith("retry_dead_peer"):
        result = retry_after_dead_peer(mesh, int(scenario[-1]))
    elif scenario == "dp_user_hook":
        # A user's gradient hook registered before wrapping (doubling every gradient): the
        # engine must average what the hook produced, as DDP does.
        model = make_model()
        for p in model.parameters():
            p.register_hook(lambda g: 2 * g)
        wrapped = torch_monarch.DataParallel(model, mesh=mesh)
        dp = mesh.group("dp")
        local = GLOBAL_BATCH // dp.size
        inputs, targets = batch(0, GLOBAL_BATCH)
        x, y = inputs[dp.rank * local:(dp.rank + 1) * local], targets[dp.rank * local:(dp.rank + 1) * local]
        loss_fn(wrapped(x), y).backward()
        result = {"grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    elif scenario == "dp_mismatch":
        model = make_model()
        if mesh.group("dp").rank == 1:
            model.extra = torch.nn.Linear(2, 2)
        torch_monarch.DataParallel(model, mesh=mesh)
        return 0
    else:
        print(f"unknown scenario {scenario!r}", file=sys.stderr)
        return 2
    torch.save(result, out_path())
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1]))
    except Exception as e:  # one line naming the rank, for the test to read
        print(f"worker error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
