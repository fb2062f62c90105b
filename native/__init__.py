"""Native sources mlcc builds against TVM's own: support headers the apache-tvm wheel lacks (tvm_support/)."""

from pathlib import Path

TVM_SUPPORT_DIR = Path(__file__).parent / "tvm_support"
