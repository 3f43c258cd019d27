"""The runtime fuzzer (fuzz.py) on a short seed set: every seeded scenario of valid and
invalid calls on 2 ranks ends within the bound with the one-process result or a clear error
on every live rank; no crash, no hang. bench/fuzz.py runs 200 seeds."""

import fuzz


def test_fuzzer_short_seed_set_has_no_crash_hang_unclear_error_or_wrong_result():
    report = fuzz.run(0, 40, timeout_s=300)
    summary = {k: report[k] for k in ("crashes", "hangs", "unclear", "wrong")}
    assert not any(summary.values()), (summary, report["out_dir"])
    # The seed set exercises faults, not only clean runs.
    kinds = {k.split("/")[0] for k in report["outcomes"]}
    assert {"none", "raise_all", "skip_step", "extra_collective"} <= kinds, report["outcomes"]
    errors = sum(n for k, n in report["outcomes"].items() if k.endswith("/error"))
    assert errors >= 10, report["outcomes"]
