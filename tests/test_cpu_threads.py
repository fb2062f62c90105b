"""TVM's CPU thread count: the physical cores of this process's affinity mask, capped by a cgroup quota, against a
fake /sys; and a real process whose count reaches TVM's pool."""

import os
import subprocess
import sys

import pytest

from mlcc.runtime.device.cpu_threads import usable_cores


def _sys(tmp_path, siblings: dict[int, str], cpu_max: str | None = None, v1: tuple[int, int] | None = None):
    for cpu, sib in siblings.items():
        d = tmp_path / f"devices/system/cpu/cpu{cpu}/topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(sib + "\n")
    if cpu_max is not None:
        (tmp_path / "fs/cgroup").mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs/cgroup/cpu.max").write_text(cpu_max + "\n")
    if v1 is not None:
        (tmp_path / "fs/cgroup/cpu").mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs/cgroup/cpu/cpu.cfs_quota_us").write_text(f"{v1[0]}\n")
        (tmp_path / "fs/cgroup/cpu/cpu.cfs_period_us").write_text(f"{v1[1]}\n")
    return tmp_path


SMT_8 = {0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 4: "0,4", 5: "1,5", 6: "2,6", 7: "3,7"}  # 4 cores x 2 threads


def test_smt_siblings_count_once(tmp_path):
    assert usable_cores(set(range(8)), _sys(tmp_path, SMT_8)) == 4


def test_no_smt_uses_every_core(tmp_path):
    # TVM alone would take half of these (it assumes two hardware threads per x86 core)
    assert usable_cores({0, 1}, _sys(tmp_path, {0: "0", 1: "1"})) == 2


def test_affinity_mask_limits(tmp_path):
    assert usable_cores({0, 4, 1}, _sys(tmp_path, SMT_8)) == 2   # core 0 (both threads) and core 1


@pytest.mark.parametrize("cpu_max,v1,want", [("150000 100000", None, 2), ("max 100000", None, 4),
                                              ("50000 100000", None, 1), (None, (200000, 100000), 2),
                                              (None, (-1, 100000), 4)])
def test_cgroup_quota_caps(tmp_path, cpu_max, v1, want):
    assert usable_cores(set(range(8)), _sys(tmp_path, SMT_8, cpu_max, v1)) == want


def _tvm_threads(env: dict[str, str], code: str = "") -> int:
    script = ("import tvm_ffi, tvm\nfrom mlcc.runtime.device.cpu_threads import configure_cpu_threads\n" + code +
              "print(tvm_ffi.get_global_func('runtime.NumThreads')())")
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")} | env
    return int(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              check=True).stdout.split()[-1])


def test_the_count_reaches_tvms_pool():
    assert _tvm_threads({}, "configure_cpu_threads()\n") == usable_cores()
    assert _tvm_threads({}, "configure_cpu_threads(1)\n") == 1
    assert _tvm_threads({"TVM_NUM_THREADS": "1"}, "configure_cpu_threads()\n") == 1  # the user's setting wins
