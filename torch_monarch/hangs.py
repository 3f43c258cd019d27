"""``python -m torch_monarch hangs DIR``: merges the flight recorder dumps the ranks wrote to
DIR (``MONARCH_FLIGHT_RECORDER_DIR``, csrc flight_recorder.h) and names the first call where
they diverged, per group: which ranks made which call, and which made another or none.

A dump holds a rank's recent collectives: per group (told apart by its store key), the
call's number on that group, the operation, element count, dtype, and the caller's phase and
step. Ranks of one group number their calls alike, so the same number must be the same call
on every member. The first number at which members differ (another operation or size, or a
member that never made it) is where the program diverged. Only numbers every member's ring
still holds are compared (a ring keeps the newest calls).
"""

import glob
import json
import os

FORMAT = "monarch-flight-recorder"


def load(directory):
    """{rank: dump} of the dumps in ``directory``. Raises ValueError naming a bad file."""
    dumps = {}
    for path in sorted(glob.glob(os.path.join(directory, "rank*.json"))):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"hangs: {path} is not readable JSON ({e})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT or "rank" not in d or \
                not isinstance(d.get("calls"), list):
            raise ValueError(f"hangs: {path} is not a {FORMAT} dump")
        dumps[int(d["rank"])] = d
    if not dumps:
        raise ValueError(f"hangs: no flight recorder dumps (rank*.json) in {directory}")
    # A directory reused across torchrun restarts: the newest attempt's dumps only.
    newest = max(d.get("attempt", 0) for d in dumps.values())
    return {r: d for r, d in dumps.items() if d.get("attempt", 0) == newest}


def _describe(call):
    size = f" of {call['numel']} {call['dtype']}" if call.get("dtype") else ""
    return f"{call['op']}{size} in {call['phase']}, step {call['step']}"


def divergences(dumps):
    """One finding per group whose members diverged, first call first: dicts with ``group``,
    ``ranks`` (the members), ``seq``, ``calls`` ({signature text: [ranks]}) and ``missing``
    (members without that call, with their last call's number and text)."""
    groups = {}
    for rank, d in dumps.items():
        for call in d["calls"]:
            g = groups.setdefault(call["key"] or call["group"], {"name": call["group"], "ranks": call["ranks"],
                                                                 "by_rank": {}})
            g["by_rank"].setdefault(rank, {})[call["seq"]] = call
    findings = []
    for key, g in groups.items():
        # Members whose dump holds calls of this group (a rank's ring, shared by all its groups,
        # may have dropped every call of a rarely used one: nothing can be said of it).
        members = [r for r in g["ranks"] if r in dumps and g["by_rank"].get(r)]
        if len(members) < 2:
            continue
        by_rank = {r: g["by_rank"][r] for r in members}
        held = [min(calls) for calls in by_rank.values() if calls]
        start = max(held) if held else 0
        last = max((max(calls) for calls in by_rank.values() if calls), default=-1)
        for seq in range(start, last + 1):
            made, missing = {}, {}
            for r in members:
                call = by_rank[r].get(seq)
                if call is None:
                    before = [s for s in by_rank[r] if s < seq]
                    prev = by_rank[r][max(before)] if before else None
                    missing[r] = (max(before), _describe(prev)) if prev else (None, "no call of this group recorded")
                else:
                    made.setdefault(_describe(call), []).append(r)
            if len(made) > 1 or (made and missing):
                findings.append({"group": g["name"], "key": key, "ranks": members, "seq": seq, "calls": made,
                                 "missing": missing})
                break
    findings.sort(key=lambda f: f["seq"])
    return findings


def report(directory):
    """The text ``python -m torch_monarch hangs DIR`` prints."""
    dumps = load(directory)
    lines = [f"{len(dumps)} rank(s) dumped: {', '.join(str(r) for r in sorted(dumps))}"]
    for rank in sorted(dumps):
        reason = dumps[rank].get("reason", "").splitlines()
        lines.append(f"  rank {rank}: {reason[0] if reason else '(no reason)'}")
    found = divergences(dumps)
    if not found:
        lines.append("no divergence: every group's members made the same calls in the same order "
                     "(a hang then lies outside the recorded collectives: a peer that died, or point-to-point "
                     "messages)")
    for f in found:
        lines.append(f"group '{f['group']}' (ranks {' '.join(map(str, f['ranks']))}) diverged at call #{f['seq']}:")
        for text, ranks in sorted(f["calls"].items(), key=lambda kv: -len(kv[1])):
            lines.append(f"  rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}")
        for r, (prev_seq, text) in sorted(f["missing"].items()):
            after = f" (its last: call #{prev_seq}, {text})" if prev_seq is not None else f" ({text})"
            lines.append(f"  rank {r}: made no call #{f['seq']}{after}")
    return "\n".join(lines)
