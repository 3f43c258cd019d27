"""Logging: the rank in every line from both the C++ runtime (spdlog) and Python (logging),
progress lines for probing, planning and checkpoints on rank 0, quiet on the other ranks by
default, MONARCH_LOG_LEVEL to turn a rank or a component up, and one clear error for a bad
value. Launched through torch_monarch.run as users launch jobs."""

import logging
import re

import pytest

from dist_harness import launch
from torch_monarch import log as monarch_log


def _lines(text, pattern):
    return [line for line in text.splitlines() if re.search(pattern, line)]


def test_rank_zero_prints_progress_and_the_others_stay_quiet():
    r = launch(2, "run", worker="log_workers.py", timeout=240)
    assert r.ok, r.describe()
    zero, one = r.errors
    # Python progress lines, with the rank.
    for what in ("probing the links", "planning", "saving checkpoint"):
        started = _lines(zero, rf"\[rank 0\] \[torch_monarch\.\w+\] \[INFO\] {what}")
        assert started, f"no '{what}' line on rank 0:\n{zero[-3000:]}"
        assert any("done in" in line for line in started), started
    assert _lines(zero, r"\[rank 0\] \[torch_monarch\.api\] \[INFO\] plan: pp=2 ")
    # C++ lines (spdlog), with the rank.
    assert _lines(zero, r"\[rank 0\] \[mesh\] \[info\] mesh pp=2 dp=1 tp=1"), zero[-3000:]
    assert _lines(zero, r"\[rank 0\] \[world\] \[info\] rendezvous with 2 ranks")
    # Rank 1: nothing at info level from either side.
    assert not _lines(one, r"\[(INFO|info)\]"), one[-3000:]


def test_monarch_log_level_turns_every_rank_and_one_component_up():
    r = launch(2, "run", worker="log_workers.py", timeout=240, env={"MONARCH_LOG_LEVEL": "info,pipeline=debug"})
    assert r.ok, r.describe()
    for rank, text in enumerate(r.errors):
        assert _lines(text, rf"\[rank {rank}\] \[mesh\] \[info\]"), text[-3000:]
        assert _lines(text, rf"\[rank {rank}\] \[pipeline\] \[debug\] step 0 on pipeline rank {rank}"), text[-3000:]
        assert _lines(text, rf"\[rank {rank}\] \[torch_monarch\.checkpoint\] \[INFO\] saving checkpoint")


def test_a_bad_level_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("MONARCH_LOG_LEVEL", "info,checkpoint=chatty")
    with pytest.raises(ValueError, match="MONARCH_LOG_LEVEL: 'checkpoint=chatty' is neither a level"):
        monarch_log.configure(rank=0)


def test_an_application_logging_config_is_kept(monkeypatch):
    monkeypatch.delenv("MONARCH_LOG_LEVEL", raising=False)
    root = logging.getLogger("torch_monarch")
    saved = (list(root.handlers), root.level, root.propagate, dict(monarch_log._state))
    try:
        for h in list(root.handlers):
            root.removeHandler(h)
        monarch_log._state["handler"] = None
        root.setLevel(logging.ERROR)  # the application's choice, before torch_monarch logs
        monarch_log.configure(rank=0)
        assert root.level == logging.ERROR and not root.handlers
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        root.propagate = saved[2]
        monarch_log._state.update(saved[3])
