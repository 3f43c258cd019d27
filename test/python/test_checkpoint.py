"""Distributed checkpoints (torch_monarch.checkpoint): save in one layout, load into another,
training continues as if never stopped; every fault is one clear error and the previous
checkpoint survives."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from torch_monarch import checkpoint
from torch_monarch.checkpoint import CheckpointError
from dist_harness import launch_with_launcher
from tiny_gpt import GLOBAL_BATCH, batch, loss_fn, make_model, make_optimizer

HERE = os.path.dirname(os.path.abspath(__file__))
K = 2  # steps before the save, and after
# Issue 12's matrix: (pp2 x tp2), (dp2 x ZeRO-3), (tp2 x dp2), one process.
# And ZeRO-3 under tp: ZeRO's rows cut from tp shards of fused (q, k, v) weights.
# dp3-zero3: three ranks, so ZeRO's rows do not divide evenly (the last shard is padded).
LAYOUTS = {"pp2-tp2": (4, "pp=2,tp=2,m=2"), "dp2-zero3": (2, "dp=2,zero=3"), "tp2-dp2": (4, "tp=2,dp=2"),
           "plain": (1, "plain"), "tp2-dp2-zero3": (4, "tp=2,dp=2,zero=3"), "dp3-zero3": (3, "dp=3,zero=3")}
# Layouts sum in different orders, so runs in two layouts differ by float32 rounding (about
# 2e-6 in parameter norm after 2 x K Adam steps here). Resuming must add nothing to that:
# losses within 1e-6, parameters no further from the target layout's uninterrupted run than
# the source layout's own uninterrupted run is (plus 1e-7), and bitwise in the same layout.
LOSS_REL = 1e-6


def _run(ranks, scenario, timeout=300):
    run = launch_with_launcher(ranks, scenario, timeout=timeout, worker="checkpoint_workers.py")
    assert run.ok, run.describe()
    return run


def _rel(a, b):
    return ((a.double() - b.double()).norm() / max(b.double().norm().item(), 1e-30)).item()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, (ranks, layout) in LAYOUTS.items():
        run = _run(ranks, f"save {layout} {root / name} {K}")
        out[name] = torch.load(os.path.join(run.out_dir, "uninterrupted.pt"))
    return root, out


@pytest.mark.parametrize("target", list(LAYOUTS))
def test_a_checkpoint_of_every_layout_resumes_in_every_layout(saved, target):
    root, uninterrupted = saved
    ranks, layout = LAYOUTS[target]
    sources = list(LAYOUTS)
    run = _run(ranks, f"resume {layout} {K} " + " ".join(str(root / s) for s in sources))
    resumed = torch.load(os.path.join(run.out_dir, "resumed.pt"))
    want = uninterrupted[target]
    for source in sources:
        got = resumed[str(root / source)]
        where = f"saved in {source}, resumed in {target}"
        if source == target:  # the same layout: bitwise
            assert got["losses"] == want["losses"][K:], where
            for k, v in want["state"].items():
                assert torch.equal(got["state"][k], v), f"{where}: {k}"
        else:
            assert got["losses"] == pytest.approx(want["losses"][K:], rel=LOSS_REL), where
            worst = max(_rel(got["state"][k], v) for k, v in want["state"].items())
            layouts_apart = max(_rel(uninterrupted[source]["state"][k], v) for k, v in want["state"].items())
            assert worst <= layouts_apart + 1e-7, \
                f"{where}: parameters differ by {worst:.2e}, the two layouts' own runs by {layouts_apart:.2e}"
            assert worst < 1e-5, where


def test_a_job_whose_rank_is_killed_restarts_from_the_latest_checkpoint(saved, tmp_path):
    # 4 ranks (tp 2 x dp 2) under the launcher with --max-restarts 1: rank 1 dies by SIGKILL
    # after step 3's save; the agent restarts every worker, which load the latest complete
    # checkpoint and finish. The result is bitwise the uninterrupted run's (same layout).
    _, uninterrupted = saved
    ranks, layout = LAYOUTS["tp2-dp2"]
    run = launch_with_launcher(ranks, f"elastic {layout} {tmp_path} {2 * K} 3", timeout=300,
                               worker="checkpoint_workers.py", extra_args=("--max-restarts", "1"))
    assert run.ok, run.describe()
    got = torch.load(os.path.join(run.out_dir, "elastic.pt"))
    assert got["attempt"] == 1 and got["start"] == 3  # restarted, from step 3's checkpoint
    want = uninterrupted["tp2-dp2"]
    assert got["losses"] == want["losses"]
    for k, v in want["state"].items():
        assert torch.equal(got["state"][k], v), k


def test_an_asynchronous_save_holds_the_step_it_was_taken_at(saved, tmp_path):
    # tp 2 x dp 2: save_async after K steps, K more steps while the files are written, then
    # wait(). Training is unchanged (bitwise the synchronous run's), and resuming from the
    # checkpoint is bitwise the uninterrupted run: it holds step K's state, not a later one.
    _, uninterrupted = saved
    ranks, layout = LAYOUTS["tp2-dp2"]
    want = uninterrupted["tp2-dp2"]
    run = _run(ranks, f"async {layout} {tmp_path / 'async'} {K}")
    got = torch.load(os.path.join(run.out_dir, "uninterrupted.pt"))
    assert got["losses"] == want["losses"]
    run = _run(ranks, f"resume {layout} {K} {tmp_path / 'async'}")
    resumed = torch.load(os.path.join(run.out_dir, "resumed.pt"))[str(tmp_path / "async")]
    assert resumed["losses"] == want["losses"][K:]
    for k, v in want["state"].items():
        assert torch.equal(resumed["state"][k], v), k


def test_an_asynchronous_save_that_fails_raises_at_wait_and_replaces_nothing(tmp_path, monkeypatch):
    model, opt = _trained()
    path = str(tmp_path / "ckpt")
    checkpoint.save(model, opt, path, step=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pending = checkpoint.save_async(model, opt, path, step=3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # after staging: not in the checkpoint
    assert pending.wait() == path
    assert checkpoint.read_index(path)[1]["step"] == 3
    fresh = make_model(seed=5)
    checkpoint.load(fresh, make_optimizer(fresh.named_parameters()), path)
    for k, v in before.items():
        assert torch.equal(fresh.state_dict()[k], v), k

    def disk_error(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write_file", disk_error)
    pending = checkpoint.save_async(model, opt, path, step=4)
    with pytest.raises(CheckpointError, match="save failed, nothing was replaced: rank 0: .*No space left"):
        pending.wait()
    assert checkpoint.read_index(path)[1]["step"] == 3
    assert not os.path.exists(path + ".partial")
    with pytest.raises(CheckpointError, match="No space left"):  # a second wait says it again
        pending.wait()
    # Not waited for: the next save finishes it first (logging the failure) and goes ahead.
    failed = checkpoint.save_async(model, opt, path, step=5)
    while not failed.done():  # its write has failed before the patch goes
        time.sleep(0.01)
    monkeypatch.undo()
    checkpoint.save(model, opt, path, step=6)
    assert checkpoint.read_index(path)[1]["step"] == 6
    with pytest.raises(CheckpointError, match="No space left"):
        failed.wait()


def test_a_version_1_checkpoint_with_crc32_still_loads_and_is_checked(tmp_path):
    import json
    import zlib
    model, opt = _trained()
    path = str(tmp_path / "v1")
    checkpoint.save(model, opt, path, step=2)
    index_path = os.path.join(path, "index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["version"] = 1
    for name, meta in index["tensors"].items():
        for s in meta["slices"]:
            with open(os.path.join(path, s["file"]), "rb") as fh:
                data = fh.read()
            header_len = int.from_bytes(data[:8], "little")
            header = json.loads(data[8:8 + header_len])
            begin, end = header[s["key"]]["data_offsets"]
            s["crc32"] = zlib.crc32(data[8 + header_len + begin:8 + header_len + end])
            del s["crc32c"]
    with open(index_path, "w") as f:
        json.dump(index, f)
    _loads_back(path, model)
    assert "crc32 " in checkpoint.inspect(path)
    first = next(iter(index["tensors"].values()))["slices"][0]
    first["crc32"] ^= 1
    with open(index_path, "w") as f:
        json.dump(index, f)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        _loads_back(path, model)


def _trained(steps=2, seed=1234):
    model = make_model(seed=seed)
    opt = make_optimizer(model.named_parameters())
    for step in range(steps):
        x, y = batch(step, GLOBAL_BATCH)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return model, opt


def _loads_back(path, model):
    fresh = make_model(seed=5)
    checkpoint.load(fresh, make_optimizer(fresh.named_parameters()), path)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_a_replacement_interrupted_between_its_renames_still_loads(tmp_path):
    # save() renames the old checkpoint to <path>.old before moving the new one in: a crash
    # between the two leaves only <path>.old (and the new one complete at <path>.partial).
    model, opt = _trained()
    path = tmp_path / "c"
    checkpoint.save(model, opt, path, step=2)
    os.rename(path, str(path) + ".old")
    directory, index = checkpoint.read_index(path)
    assert directory == str(path) + ".old" and index["step"] == 2
    _loads_back(path, model)
    checkpoint.save(model, opt, path, step=3)  # the next save cleans up
    assert not os.path.exists(str(path) + ".old") and checkpoint.read_index(path)[1]["step"] == 3


def _files(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def test_corrupt_truncated_and_missing_files_are_named_and_change_nothing(tmp_path):
    model, opt = _trained()
    good = tmp_path / "good"
    checkpoint.save(model, opt, good, step=2)
    bad = tmp_path / "bad"
    checkpoint.save(model, opt, bad, step=2)
    (name,) = _files(bad)
    target = make_model(seed=5)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    data = bytearray((bad / name).read_bytes())
    import json, struct  # noqa: E401
    (n,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8:8 + n])["blocks.1.fc1.weight@0,0"]["data_offsets"]
    data[8 + n + (begin + end) // 2] ^= 0x40  # one bit, in the middle of a weight's bytes
    (bad / name).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{name}: tensor 'blocks.1.fc1.weight@0,0' fails its checksum"):
        checkpoint.load(target, None, bad)
    (bad / name).write_bytes(bytes(data[: len(data) // 3]))
    with pytest.raises(CheckpointError, match=f"{name} is truncated"):
        checkpoint.load(target, None, bad)
    os.remove(bad / name)
    with pytest.raises(CheckpointError, match=f"cannot open .*{name}"):
        checkpoint.load(target, None, bad)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())  # nothing overwritten
    _loads_back(good, model)


def test_a_checkpoint_of_another_model_or_shape_is_refused_by_tensor(tmp_path):
    model, opt = _trained()
    checkpoint.save(model, opt, tmp_path / "c", step=2)
    other = make_model(layers=3)
    with pytest.raises(CheckpointError, match="has no tensor 'blocks.2.ln1.weight'"):
        checkpoint.load(other, None, tmp_path / "c")
    wider = torch.nn.Linear(4, 4)
    with pytest.raises(CheckpointError, match="has no tensor 'weight'"):
        checkpoint.load(wider, None, tmp_path / "c")
    resized = make_model()
    resized.wpe = torch.nn.Embedding(32, 32)
    with pytest.raises(CheckpointError, match=r"tensor 'wpe.weight' is \[16, 32\] .* the model has \[32, 32\]"):
        checkpoint.load(resized, None, tmp_path / "c")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        checkpoint.load(model, None, tmp_path / "nowhere")
    fresh = make_model()
    with pytest.raises(CheckpointError, match="no optimizer state"):
        checkpoint.save(fresh, None, tmp_path / "weights-only")
        checkpoint.load(fresh, make_optimizer(fresh.named_parameters()), tmp_path / "weights-only")


_FULL_DISK = """
import resource, signal, sys, torch
sys.path.insert(0, {here!r})
from torch_monarch import checkpoint
from tiny_gpt import make_model, make_optimizer
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
model = make_model()
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))  # a disk with 20 kB free per file
try:
    checkpoint.save(model, None, {path!r}, step=9)
except checkpoint.CheckpointError as e:
    print(e)
    sys.exit(3)
"""


def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path):
    model, opt = _trained()
    path = tmp_path / "c"
    checkpoint.save(model, opt, path, step=2)
    proc = subprocess.run([sys.executable, "-c", _FULL_DISK.format(here=HERE, path=str(path))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "save failed, nothing was replaced" in proc.stdout and "File too large" in proc.stdout
    assert checkpoint.read_index(path)[1]["step"] == 2
    _loads_back(path, model)


_SLOW_SAVE = """
import sys, torch
from torch_monarch import checkpoint
model = torch.nn.Linear(8192, 8192)  # 256 MiB of fp32: the save takes a moment
print("saving", flush=True)
while True:
    checkpoint.save(model, None, {path!r}, step=7)
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    model, opt = _trained()
    path = tmp_path / "c"
    checkpoint.save(model, opt, path, step=2)
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_SAVE.format(path=str(path))], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "saving"
    partial = str(path) + ".partial"
    deadline = time.time() + 60
    while not (os.path.isdir(partial) and os.listdir(partial)) and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # mid-write: the partial directory has a file being written
    proc.wait()
    # The index names whichever checkpoint is complete: the old one, unless the killed
    # process got through a whole save of the new one first. Either loads.
    directory, index = checkpoint.read_index(path)
    assert index["step"] in (2, 7)
    if index["step"] == 2:
        _loads_back(directory, model)
    else:
        checkpoint.load(torch.nn.Linear(8192, 8192), None, directory)
    # A later save replaces the leftovers.
    checkpoint.save(model, opt, path, step=3)
    assert not os.path.exists(partial) and checkpoint.read_index(path)[1]["step"] == 3
    _loads_back(path, model)


def test_inspect_consolidate_and_import(tmp_path):
    model, opt = _trained()
    checkpoint.save(model, opt, tmp_path / "c", step=2)
    text = checkpoint.inspect(tmp_path / "c")
    assert "step 2" in text and "blocks.0.qkv.weight [param] F32 [96, 32]" in text and "crc32" in text
    assert "optimizer.blocks.0.qkv.weight.exp_avg [optimizer]" in text
    out = tmp_path / "model.safetensors"
    proc = subprocess.run([sys.executable, "-m", "torch_monarch.checkpoint", "consolidate", str(tmp_path / "c"),
                           "-o", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # A safetensors reader's view (header + raw bytes): every weight, whole; no optimizer state.
    import json, struct  # noqa: E401
    raw = out.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert set(header) == set(model.state_dict()) - {"head.weight"} | {"wte.weight"}
    w = header["blocks.0.qkv.weight"]
    start = 8 + n + w["data_offsets"][0]
    values = torch.frombuffer(bytearray(raw[start:8 + n + w["data_offsets"][1]]), dtype=torch.float32)
    assert torch.equal(values.view(96, 32), model.blocks[0].qkv.weight.detach())
    checkpoint.import_safetensors(out, tmp_path / "imported")
    fresh = make_model(seed=5)
    checkpoint.load(fresh, None, tmp_path / "imported")
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    proc = subprocess.run([sys.executable, "-m", "torch_monarch.checkpoint", "inspect", str(tmp_path / "none")],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.startswith("monarch-ckpt: error: checkpoint: no complete checkpoint")


@pytest.mark.parametrize("ranks,optimizer,save_layout,load_layout", [
    (2, "rowwise_adagrad", "row_wise", "column_wise"),
    (2, "rowwise_adagrad", "column_wise", "row_wise"),  # a rank holds two chunks of a table's rows
    (4, "adam", "table_wise", "row_wise"),  # 3 tables on 4 ranks: one rank holds none
])
def test_sharded_embedding_tables_and_their_optimizer_state_resume_in_another_sharding(ranks, optimizer, save_layout,
                                                                                       load_layout, tmp_path):
    # Tables sharded one way with a fused sparse optimizer, the head data-parallel; the
    # checkpoint holds each rank's shards (no gather) and the optimizer state, and a model
    # sharded another way resumes exactly where the uninterrupted run went.
    run = launch_with_launcher(ranks, f"checkpoint:{optimizer}:{save_layout}:{load_layout}:{tmp_path / 'ckpt'}",
                               timeout=300, worker="embedding_workers.py")
    assert run.ok, run.describe()
    got = torch.load(os.path.join(run.out_dir, "rank0.pt"))
    assert got["resumed"] == pytest.approx(got["uninterrupted"][2:], rel=1e-6)
    for name, table in got["tables"].items():
        assert torch.allclose(got["resumed_tables"][name], table, rtol=1e-6, atol=1e-7), name
    _, index = checkpoint.read_index(tmp_path / "ckpt")
    weight = index["tensors"]["emb.tables.odd.weight"]
    assert weight["shape"] == [97, 16]
    if save_layout == "row_wise":
        assert len(weight["slices"]) == 2  # each rank wrote its rows
    if optimizer == "rowwise_adagrad":
        assert "optimizer.emb.tables.odd.weight.sum" in index["tensors"]
    else:
        assert "optimizer.emb.tables.odd.weight.exp_avg" in index["tensors"]
        assert "optimizer.emb.tables.step" in index["tensors"]


def test_sharded_tables_in_a_model_without_a_mesh_are_refused_on_every_rank(tmp_path):
    run = launch_with_launcher(2, f"checkpoint_without_mesh:{tmp_path / 'ckpt'}", timeout=300,
                               worker="embedding_workers.py")
    assert run.ok, run.describe()
    for rank in range(2):
        got = torch.load(os.path.join(run.out_dir, f"rank{rank}.pt"))
        assert got["error"] and "spread over the ranks but the model has no mesh" in got["error"], got
    assert not os.path.exists(tmp_path / "ckpt") and not os.path.exists(str(tmp_path / "ckpt") + ".partial")
