"""Native sources mlcc builds against TVM's own: support headers the apache-tvm wheel lacks (tvm_support/), and the
cuBLASLt shim built on first use (cublaslt/, cublaslt_shim.py)."""

from pathlib import Path

TVM_SUPPORT_DIR = Path(__file__).parent / "tvm_support"
