"""How long importing TVM's tensor-core intrinsics takes, as TVM does it and through mlcc's preload, each in a fresh
interpreter with mlcc and TVM already imported (issue 4, compile time). Runs here, no GPU:

    python bench/tensor_intrin_import.py
"""

from __future__ import annotations

import subprocess
import sys

SETUP = "import sys, time, tvm, mlcc.compiler.build\nn = len(sys.modules)\nt = time.time()\n"
WAYS = {
    "tvm": "import tvm.s_tir.tensor_intrin\n",
    "mlcc preload": "from mlcc.schedules.tensor_intrinsics import preload\npreload()\n",
}

if __name__ == "__main__":
    for name, body in WAYS.items():
        code = SETUP + body + "print(f'{time.time() - t:.1f} s with {n} modules loaded')\n"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        print(f"{name:14s} {r.stdout.strip()}")
