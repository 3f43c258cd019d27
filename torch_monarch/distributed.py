"""Process bootstrap and device mesh for the runtime (thin shells over torch_monarch._runtime).

``init()`` reads torchrun's environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, ...)
and rendezvouses through a c10d TCPStore; if ``torch.distributed`` is already initialized
it joins that process group's store instead of opening a second port.
"""

import torch  # noqa: F401  (registers the tensor and c10d types _runtime uses)
import torch.distributed as dist

from . import compat

compat.check_supported()  # before the runtime extension loads: a torch outside 2.9-2.14 is named
compat.guard_gloo_exit()
from . import _runtime  # noqa: E402
from . import log as _log  # noqa: E402

_world = None


def init(timeout: float = 300.0):
    """Joins the job's ranks (idempotent). ``timeout`` (seconds) bounds the rendezvous and
    every collective: a dead peer becomes an error naming the rank and the collective."""
    global _world
    if _world is not None:
        return _world
    if dist.is_available() and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
        _world = _runtime.World.from_store(store, dist.get_rank(), dist.get_world_size(), timeout)
    else:
        _world = _runtime.World.init(timeout)
    _log.configure(rank=_world.rank)
    _log.get("distributed").info("joined a world of %d ranks", _world.size)
    return _world


def device_mesh(pp: int = 1, dp: int = None, tp: int = 1, cp: int = 1, ep: int = 1, world=None):
    """A mesh with named axes ``pp``, ``dp``, ``cp``, ``tp`` (rank order pp, dp, cp, tp: tp
    innermost; cp only when > 1). ``ep`` splits a MoE layer's experts over ep of the dp x cp
    ranks (groups ``ep`` and ``edp``, see monarch/runtime/device_mesh.h). ``dp`` defaults to
    whatever the world leaves. Every rank must call it."""
    world = world or init()
    if dp is None:
        if world.size % (pp * cp * tp) != 0:
            raise ValueError(f"mesh: pp*cp*tp = {pp * cp * tp} does not divide the world size {world.size}")
        dp = world.size // (pp * cp * tp)
    return _runtime.DeviceMesh(world, pp=pp, dp=dp, tp=tp, cp=cp, ep=ep)


def mesh_from_plan(plan, world=None):
    """The mesh a Plan (torch_monarch.planner.Plan) asks for."""
    return device_mesh(pp=plan.mesh.pp, dp=plan.mesh.dp, tp=plan.mesh.tp, cp=plan.mesh.cp, ep=plan.mesh.ep,
                       world=world)
