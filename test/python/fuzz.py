"""Driver of the runtime fuzzer (fuzz_workers.py): runs a range of seeds on 2 ranks,
restarting the ranks after a scenario that killed one, and judges every seed:

* no fault fired (or one the runtime must absorb: the same error on every rank, retried; a
  state dict on one rank of a plain DataParallel model, which is local): both ranks finish
  with the one-process losses (within 1e-5) and the same parameters;
* any other fault: every live rank ends with a clear error: one naming a rank and the group
  (or saying every rank must call the operation, or naming the options that differ);
* never: a process dying by a signal it was not sent, a seed taking longer than the bound,
  or a live rank with no record of a seed (a hang).

Used by test_fuzz.py (a short seed set in make test) and bench/fuzz.py (200 seeds).
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fuzz_workers import reference, scenario  # noqa: E402

SEED_BOUND_S = 40


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(out_dir):
    got = {}
    for rank in range(2):
        path = os.path.join(out_dir, f"rank{rank}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    r = json.loads(line)
                    got[(r["seed"], rank)] = r
    return got


def expected(sc):
    """'ok' or 'error' (what every live rank must end with)."""
    fired = sc["at"] < sc["steps"]
    fault = sc["fault"] if fired or sc["fault"] == "bucket_mismatch" else "none"
    if fault in ("none", "raise_all"):
        return "ok"
    if fault == "state_dict_alone" and sc["engine"] == "dp":
        return "ok"
    if fault == "bucket_mismatch" and sc["engine"] != "dp":
        return "ok"  # ZeRO has no buckets
    return "error"


NAMED = ("not making the same collective call", "every rank must call it", "were given different options")


def clear(message):
    """Names a rank and the group or the operation."""
    return "rank " in message and any(k in message for k in ("group '", *NAMED))


def run(first, last, timeout_s=600):
    out_dir = tempfile.mkdtemp(prefix="monarch-fuzz-")
    start = time.monotonic()
    launches, killed, crashes = 0, {}, []
    seed = first
    while seed < last and time.monotonic() - start < timeout_s:
        launches += 1
        ports = (_port(), _port())
        procs = []
        for rank in range(2):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), RANK=str(rank),
                       WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1",
                       MONARCH_TIMEOUT_S="15", MONARCH_ENTRY_TIMEOUT_S="2")
            err = open(os.path.join(out_dir, f"launch{launches}.rank{rank}.stderr"), "w")
            procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "fuzz_workers.py"), str(seed), str(last),
                                           out_dir, str(ports[1])], env=env, stdout=subprocess.DEVNULL, stderr=err))
        codes = [None, None]
        stopped_at = None
        while any(c is None for c in codes):
            time.sleep(0.05)
            for rank, p in enumerate(procs):
                if codes[rank] is None:
                    codes[rank] = p.poll()
            got = _records(out_dir)
            progress = seed
            while progress < last and (progress, 0) in got and (progress, 1) in got:
                progress += 1
            dead = [r for r in range(2) if codes[r] is not None and codes[r] != 0]
            if dead and stopped_at is None:
                stopped_at = time.monotonic()
            # A rank is gone (killed by its scenario, or crashed): once the survivor has written
            # its record of that seed (or the bound passed), stop it too and restart after it.
            if stopped_at is not None:
                survivor_done = all((progress, r) in got for r in range(2) if codes[r] is None)
                if survivor_done or time.monotonic() - stopped_at > SEED_BOUND_S:
                    for rank, p in enumerate(procs):
                        if codes[rank] is None:
                            p.kill()
                            codes[rank] = "stopped"
                            p.wait()
            if time.monotonic() - start > timeout_s:
                for rank, p in enumerate(procs):
                    if codes[rank] is None:
                        p.kill()
                        codes[rank] = "stopped"
                        p.wait()
        got = _records(out_dir)
        stop = seed
        while stop < last and (stop, 0) in got and (stop, 1) in got:
            stop += 1
        if stop >= last:
            break
        sc = scenario(stop)
        for rank, code in enumerate(codes):
            if code == -9 and sc["fault"] == "kill" and rank == sc["rank"]:
                killed[stop] = rank
            elif isinstance(code, int) and code not in (0, 4):  # 4: the peer was gone (see fuzz_workers)
                crashes.append({"seed": stop, "rank": rank, "exit": code})
        # The seed where the launch stopped is judged from what was recorded (a live rank
        # without a record there is a hang); the next launch starts after it.
        seed = stop + 1
    got = _records(out_dir)
    report = {"seeds": last - first, "launches": launches, "seconds": time.monotonic() - start,
              "crashes": crashes, "hangs": [], "unclear": [], "wrong": [], "outcomes": {}}
    ref_cache = {}
    for s in range(first, last):
        sc = scenario(s)
        want = expected(sc)
        dead = killed.get(s)
        live = [r for r in range(2) if r != dead]
        recs = {r: got.get((s, r)) for r in live}
        key = f"{sc['fault']}/{want}"
        report["outcomes"][key] = report["outcomes"].get(key, 0) + 1
        for r, rec in recs.items():
            if rec is None:
                report["hangs"].append({"seed": s, "rank": r, "scenario": sc})
            elif rec["seconds"] > SEED_BOUND_S:
                report["hangs"].append({"seed": s, "rank": r, "seconds": rec["seconds"], "scenario": sc})
        if any(rec is None for rec in recs.values()):
            continue
        if want == "ok":
            if sc["steps"] not in ref_cache:
                ref_cache[sc["steps"]] = reference(sc["steps"])
            ref = ref_cache[sc["steps"]]
            for r, rec in recs.items():
                good = rec["outcome"] == "ok" and len(rec["losses"]) == len(ref) and all(
                    abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(rec["losses"], ref))
                if good and r == 1 and recs.get(0):
                    good = abs(rec["checksum"] - recs[0]["checksum"]) <= 1e-6 * max(1.0, abs(rec["checksum"]))
                if not good:
                    report["wrong"].append({"seed": s, "rank": r, "scenario": sc, "got": rec, "reference": ref})
        else:
            for r, rec in recs.items():
                if rec["outcome"] != "error" or not clear(rec.get("error", "")):
                    report["unclear"].append({"seed": s, "rank": r, "scenario": sc, "got": rec})
            # Misuse (not a kill) must be diagnosed as such on some rank: a peer may only see
            # the diagnosing rank leave, but a plain timeout everywhere would not say what went wrong.
            if sc["fault"] != "kill" and not any(any(k in (rec.get("error") or "") for k in NAMED)
                                                 for rec in recs.values()):
                report["unclear"].append({"seed": s, "scenario": sc, "why": "no rank named the misuse",
                                          "got": list(recs.values())})
    report["out_dir"] = out_dir
    return report
