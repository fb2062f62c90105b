"""How many threads TVM's CPU thread pool gets: the cores this process may actually use.

TVM sizes its pool once, when the first parallel kernel runs, from TVM_NUM_THREADS (or OMP_NUM_THREADS), else from
hardware_concurrency halved on x86 ("ignore hyper-threading"): on a machine without SMT, or in a container limited
to fewer CPUs, that is the wrong count. We count the physical cores among the CPUs of this process's affinity mask,
capped by a cgroup CPU quota, and set TVM_NUM_THREADS before the pool exists (a count given by the user, in the
environment or as `num_threads`, wins).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)

_configured: int | None = None


def _physical_cores(cpus: set[int], sys_root: Path) -> int:
    """Distinct cores (SMT siblings counted once) among `cpus`; len(cpus) where the topology is unreadable."""
    cores = set()
    for cpu in cpus:
        siblings = sys_root / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return len(cores)


def _cgroup_cpu_limit(sys_root: Path) -> float | None:
    """CPUs the cgroup quota allows (cgroup v2 cpu.max, else v1 cfs quota/period); None without a quota."""
    try:
        quota, period = (sys_root / "fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((sys_root / "fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int((sys_root / "fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cores(affinity: set[int] | None = None, sys_root: Path = Path("/sys")) -> int:
    """Physical cores in this process's affinity mask, at most the cgroup quota (rounded up), at least 1."""
    if affinity is None:
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = _physical_cores(affinity, sys_root)
    limit = _cgroup_cpu_limit(sys_root)
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit)))
    return max(1, cores)


def configure_cpu_threads(num_threads: int | None = None) -> int:
    """Size TVM's CPU thread pool (before its first use): `num_threads`, else TVM_NUM_THREADS / OMP_NUM_THREADS
    as set, else usable_cores(). Returns the count, logged once."""
    global _configured
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    env = os.environ.get("TVM_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if num_threads is not None:
        count, why = num_threads, "asked for"
    elif env:
        count, why = int(env), "from the environment"
    else:
        count, why = usable_cores(), "the usable physical cores"
    if _configured is None:
        os.environ["TVM_NUM_THREADS"] = str(count)
        _configured = count
        log.info("CPU threads: %d (%s)", count, why)
    elif count != _configured:
        # TVM's pool keeps the size it started with; fewer threads can still be asked of it
        import tvm_ffi

        tvm_ffi.get_global_func("runtime.config_threadpool")(1, min(count, _configured))
        if count > _configured:
            log.warning("CPU threads: %d asked for, but this process's thread pool started with %d", count,
                        _configured)
    return count
