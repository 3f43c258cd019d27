"""Logging of torch_monarch: Python ``logging`` under the ``torch_monarch`` logger, with the
rank in every line, and progress lines for what takes seconds (probing the machine, reading a
large model, planning, checkpoint save and load).

Levels follow ``MONARCH_LOG_LEVEL``, the same variable as the C++ runtime's loggers
(csrc/include/monarch/runtime/log.h): a level (``debug``, ``info``, ``warn``, ``error``,
``off``) for every component, then ``component=level`` pairs (``warn,checkpoint=debug``;
components are the module names: ``cluster``, ``graph``, ``api``, ``checkpoint``, ...). Unset:
``info`` on rank 0 and ``warn`` elsewhere, so a job prints its progress once, not once per
rank. An application that configured logging itself (handlers or a level on the
``torch_monarch`` logger, or handlers on the root logger, as ``logging.basicConfig`` adds)
keeps its configuration, and torch_monarch's records reach its handlers.
"""

import contextlib
import logging
import os
import sys
import time

ROOT = "torch_monarch"
_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
           "warning": logging.WARNING, "error": logging.ERROR, "off": logging.CRITICAL + 10}
_state = {"rank": None, "handler": None}


def _spec():
    """(default level name or None, {component: level name}) from MONARCH_LOG_LEVEL."""
    default, per = None, {}
    for item in filter(None, os.environ.get("MONARCH_LOG_LEVEL", "").split(",")):
        name, sep, value = item.rpartition("=")
        if value not in _LEVELS or (sep and not name):
            raise ValueError(f"MONARCH_LOG_LEVEL: '{item}' is neither a level ({', '.join(sorted(_LEVELS))}) "
                             "nor component=level")
        if sep:
            per[name] = value
        else:
            default = value
    return default, per


class _RankFilter(logging.Filter):
    def filter(self, record):
        rank = _state["rank"]
        # Before init() (or in one process without it): the launcher's RANK, else rank 0.
        record.monarch_rank = os.environ.get("RANK", "0") if rank is None else rank
        return True


def configure(rank=None):
    """Sets the rank shown in every line and the levels from the environment (called by
    ``torch_monarch.init()`` once the rank is known; before, lines show the launcher's
    ``RANK``, or 0 in a process started without one)."""
    if rank is not None:
        _state["rank"] = rank
    root = logging.getLogger(ROOT)
    default, per = _spec()
    ours = _state["handler"]
    # The application's configuration wins: handlers or a level on torch_monarch's logger, or
    # handlers on the root logger (logging.basicConfig), which torch_monarch's records then
    # reach by propagation as before.
    user_configured = (root.handlers and ours not in root.handlers) or \
        (ours is None and (root.level != logging.NOTSET or logging.getLogger().handlers))
    if not user_configured:
        if ours is None:
            ours = logging.StreamHandler(sys.stderr)
            ours.setFormatter(logging.Formatter("[%(asctime)s] [rank %(monarch_rank)s] [%(name)s] "
                                                "[%(levelname)s] %(message)s", "%H:%M:%S"))
            ours.addFilter(_RankFilter())
            root.addHandler(ours)
            root.propagate = False
            _state["handler"] = ours
        level = default or ("info" if (_state["rank"] or 0) == 0 else "warn")
        root.setLevel(_LEVELS[level])
    for component, level in per.items():
        logging.getLogger(f"{ROOT}.{component}").setLevel(_LEVELS[level])


def get(component):
    """The logger of one component (``torch_monarch.<component>``)."""
    if _state["handler"] is None:
        configure()
    return logging.getLogger(f"{ROOT}.{component}")


@contextlib.contextmanager
def progress(component, what, **details):
    """Logs ``what ...`` when it starts and ``what: done in N s`` when it ends (or ``failed
    after N s``), at info level: seen on rank 0 by default."""
    logger = get(component)
    extra = "".join(f", {k}={v}" for k, v in details.items())
    logger.info("%s ...%s", what, extra)
    start = time.monotonic()
    try:
        yield logger
    except BaseException:
        logger.info("%s: failed after %.2f s", what, time.monotonic() - start)
        raise
    logger.info("%s: done in %.2f s", what, time.monotonic() - start)
