// cuBLASLt GEMMs for TVM-compiled models, reached as tvm-ffi global functions:
//   mlcc.cublaslt.matmul(x, w, workspace, out)               out = x @ w^T
//   mlcc.cublaslt.matmul_bias(x, w, bias, workspace, out)    out = x @ w^T + bias[n]
//   mlcc.cublaslt.matmul_add(x, w, residual, workspace, out) out = x @ w^T + residual
//   mlcc.cublaslt.matmul_fp8[_bias|_add](xq, x_scale, w, w_scale, [extra,] workspace, out)
//       out = (x_scale[m] xq[m, K]) @ (w_scale[n] w[N, K])^T [+ bias | + residual]: e4m3 activations quantized per
//       token and e4m3 weights with one scale per output channel, out float16 or bfloat16. The scales are applied
//       inside cuBLASLt's epilogue as outer vectors (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F: D[i, j] is
//       multiplied by A's scale i and B's scale j), cuBLAS 12.9+ on sm_90+.
//   mlcc.cublaslt.init(device_id)                            creates the handle (before any graph capture)
//   mlcc.cublaslt.cache_size() -> int                        shapes planned so far
// x: [..., K] (rows = the product of the leading dims), w: [N, K] (a Linear weight, [out, in]), fp16 or bf16;
// out: [..., N]. workspace: a uint8 tensor TVM allocated; its size bounds the algorithms considered.
//
// Each call launches on the stream tvm-ffi reports for the device (TVM switches it for graph capture). Per shape
// the descriptors are created once; the algorithm is the fastest of the heuristic's candidates, timed on the first
// call of each token-count bucket. Under stream capture nothing is timed, allocated on the device or created
// beyond host-side descriptors: an untimed shape takes the heuristic's first choice.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace {

using tvm::ffi::TensorView;

constexpr int kCandidates = 8;   // heuristic results timed per bucket
constexpr int kTimedRuns = 3;    // after one warm-up run each

enum Epilogue : int { kNone = 0, kBias = 1, kAdd = 2 };

#define MLCC_CUBLAS_CHECK(expr)                                                                  \
  do {                                                                                           \
    cublasStatus_t _s = (expr);                                                                  \
    if (_s != CUBLAS_STATUS_SUCCESS) {                                                           \
      TVM_FFI_THROW(RuntimeError) << "cuBLASLt: " #expr " failed: " << cublasLtGetStatusString(_s); \
    }                                                                                            \
  } while (0)

#define MLCC_CUDA_CHECK(expr)                                                                    \
  do {                                                                                           \
    cudaError_t _e = (expr);                                                                     \
    if (_e != cudaSuccess) {                                                                     \
      TVM_FFI_THROW(RuntimeError) << "CUDA: " #expr " failed: " << cudaGetErrorString(_e);      \
    }                                                                                            \
  } while (0)

// (M, N, K, dtype code (the inputs'), epilogue, device); FP8 plans add the output's code times 1000 to the first
using ShapeKey = std::tuple<int64_t, int64_t, int64_t, int, int, int>;

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  bool timed = false;
};

struct State {
  std::mutex mu;
  std::map<int, cublasLtHandle_t> handles;
  std::map<ShapeKey, Plan> plans;
  // the algorithm timed for a token-count bucket (Bucket), reused (after a validity check) by its other counts
  std::map<ShapeKey, std::pair<cublasLtMatmulAlgo_t, size_t>> tuned;
};

State& state() {
  static State* s = new State();  // never destroyed: calls may come from other static destructors' threads
  return *s;
}

// Token counts share a timed algorithm within a quarter of an octave (257-320, 321-384, ...): a whole octave let
// the algorithm timed at 300 tokens run 512 at 0.58x of cuBLAS's own choice on an H100.
int64_t Bucket(int64_t m) {
  int64_t p = 1;
  while (p * 2 <= m) p <<= 1;
  const int64_t step = p >= 4 ? p / 4 : 1;
  return (m + step - 1) / step * step;
}

bool Capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MLCC_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

cublasLtHandle_t Handle(State& s, int device, bool capturing) {
  auto it = s.handles.find(device);
  if (it != s.handles.end()) return it->second;
  if (capturing) {
    TVM_FFI_THROW(RuntimeError) << "cuBLASLt: no handle for device " << device
                                << " during CUDA-graph capture; call mlcc.cublaslt.init first";
  }
  cublasLtHandle_t h;
  MLCC_CUBLAS_CHECK(cublasLtCreate(&h));
  s.handles[device] = h;
  return h;
}

bool IsE4m3(const DLDataType& t) { return t.code == kDLFloat8_e4m3fn && t.bits == 8 && t.lanes == 1; }

cudaDataType_t DataType(const DLDataType& t) {
  if (t.code == kDLFloat && t.bits == 16 && t.lanes == 1) return CUDA_R_16F;
  if (t.code == kDLBfloat && t.bits == 16 && t.lanes == 1) return CUDA_R_16BF;
  TVM_FFI_THROW(TypeError) << "mlcc.cublaslt: float16 or bfloat16 tensors expected";
  return CUDA_R_16F;
}

void* Data(const TensorView& t) { return static_cast<char*>(t.data_ptr()) + t.byte_offset(); }

// Row-major out[M, N] = x[M, K] w[N, K]^T is column-major out^T[N, M] = w^T x with w read transposed ("TN", also
// the one layout FP8 GEMMs take on Hopper). `in` is the inputs' type (dt, or e4m3 with per-vector scales).
Plan MakePlan(cudaDataType_t dt, int64_t m, int64_t n, int64_t k, int epilogue, const void* bias,
              cudaDataType_t in) {
  Plan p;
  MLCC_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  MLCC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  MLCC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (epilogue == kBias) {
    cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_BIAS;
    MLCC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)));
    cudaDataType_t bt = dt;
    MLCC_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
    MLCC_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  if (in == CUDA_R_8F_E4M3) {
    // A = the weights (n rows of D: one scale per channel), B = the activations (m columns: one per token)
    const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    MLCC_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof(mode)));
    MLCC_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof(mode)));
  }
  MLCC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, in, k, n, k));
  MLCC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, in, k, m, k));
  MLCC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, dt, n, m, n));
  return p;
}

struct Operands {
  const void* w;
  const void* x;
  const void* c;  // residual (kAdd) or out
  void* out;
  void* workspace;
};

cublasStatus_t Run(cublasLtHandle_t h, const Plan& p, const cublasLtMatmulAlgo_t* algo, size_t ws,
                   const Operands& o, float beta, cudaStream_t stream) {
  const float alpha = 1.0f;
  return cublasLtMatmul(h, p.desc, &alpha, o.w, p.a, o.x, p.b, &beta, o.c, p.c, o.out, p.c, algo, o.workspace, ws,
                        stream);
}

std::vector<cublasLtMatmulHeuristicResult_t> Candidates(cublasLtHandle_t h, const Plan& p, size_t ws_bytes,
                                                       int count) {
  cublasLtMatmulPreference_t pref;
  MLCC_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t limit = ws_bytes;
  MLCC_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &limit,
                                                         sizeof(limit)));
  std::vector<cublasLtMatmulHeuristicResult_t> res(count);
  int found = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h, p.desc, p.a, p.b, p.c, p.c, pref, count, res.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) found = 0;
  res.resize(found);
  return res;
}

// The fastest candidate on this stream: kTimedRuns after a warm-up each, outputs overwritten (x, w and the
// residual are only read, so every run computes the same result).
bool TimeBest(cublasLtHandle_t h, Plan* p, const std::vector<cublasLtMatmulHeuristicResult_t>& cands,
              const Operands& o, float beta, cudaStream_t stream) {
  cudaEvent_t start, stop;
  MLCC_CUDA_CHECK(cudaEventCreate(&start));
  MLCC_CUDA_CHECK(cudaEventCreate(&stop));
  float best = -1.0f;
  for (const auto& c : cands) {
    if (Run(h, *p, &c.algo, c.workspaceSize, o, beta, stream) != CUBLAS_STATUS_SUCCESS) continue;
    MLCC_CUDA_CHECK(cudaEventRecord(start, stream));
    bool ok = true;
    for (int i = 0; i < kTimedRuns && ok; ++i) {
      ok = Run(h, *p, &c.algo, c.workspaceSize, o, beta, stream) == CUBLAS_STATUS_SUCCESS;
    }
    MLCC_CUDA_CHECK(cudaEventRecord(stop, stream));
    MLCC_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    MLCC_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (ok && (best < 0 || ms < best)) {
      best = ms;
      p->algo = c.algo;
      p->workspace = c.workspaceSize;
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best >= 0;
}

// Per-vector scales of an FP8 product: the weights' (n) and the activations' (m), float32 on the device.
struct Scales {
  const TensorView* w;
  const TensorView* x;
};

void SetScales(Plan& p, const void* w_scale, const void* x_scale) {
  MLCC_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scale, sizeof(w_scale)));
  MLCC_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scale, sizeof(x_scale)));
}

void Matmul(const TensorView& x, const TensorView& w, const TensorView* extra, int epilogue,
            const TensorView& workspace, const TensorView& out, const Scales* scales = nullptr) {
  TVM_FFI_CHECK(x.device().device_type == kDLCUDA, ValueError) << "mlcc.cublaslt: CUDA tensors expected";
  TVM_FFI_CHECK(w.ndim() == 2 && x.ndim() >= 1 && out.ndim() == x.ndim(), ValueError)
      << "mlcc.cublaslt: x [..., K], w [N, K], out [..., N] expected";
  const int64_t k = x.shape()[x.ndim() - 1], n = w.shape()[0];
  const int64_t m = k > 0 ? x.numel() / k : 0;
  TVM_FFI_CHECK(w.shape()[1] == k && out.shape()[out.ndim() - 1] == n && out.numel() == m * n, ValueError)
      << "mlcc.cublaslt: shapes disagree (x [" << m << ", " << k << "], w [" << w.shape()[0] << ", "
      << w.shape()[1] << "])";
  const cudaDataType_t dt = DataType(out.dtype());
  cudaDataType_t in = dt;
  if (scales != nullptr) {
    TVM_FFI_CHECK(IsE4m3(x.dtype()) && IsE4m3(w.dtype()), TypeError)
        << "mlcc.cublaslt: float8_e4m3fn x and w expected";
    for (const auto& [t, len] : {std::pair{scales->w, n}, std::pair{scales->x, m}}) {
      TVM_FFI_CHECK(t->numel() == len && t->dtype().code == kDLFloat && t->dtype().bits == 32, ValueError)
          << "mlcc.cublaslt: float32 scales, one per weight row and one per token, expected";
    }
    TVM_FFI_CHECK(k % 16 == 0, ValueError) << "mlcc.cublaslt: FP8 rows of a multiple of 16 bytes expected";
    in = CUDA_R_8F_E4M3;
  } else {
    TVM_FFI_CHECK(DataType(x.dtype()) == dt && DataType(w.dtype()) == dt, TypeError)
        << "mlcc.cublaslt: x, w and out must share one dtype";
  }
  if (epilogue == kBias) {
    TVM_FFI_CHECK(extra->numel() == n && DataType(extra->dtype()) == dt, ValueError)
        << "mlcc.cublaslt: bias [N] expected";
  } else if (epilogue == kAdd) {
    TVM_FFI_CHECK(extra->numel() == m * n && DataType(extra->dtype()) == dt, ValueError)
        << "mlcc.cublaslt: residual shaped like out expected";
  }
  if (m == 0) return;
  const int device = x.device().device_id;
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  const bool capturing = Capturing(stream);
  const size_t ws_bytes = static_cast<size_t>(workspace.numel()) * ((workspace.dtype().bits + 7) / 8);
  const void* bias = epilogue == kBias ? Data(*extra) : nullptr;
  Operands o{Data(w), Data(x), epilogue == kAdd ? Data(*extra) : Data(out), Data(out), Data(workspace)};
  const float beta = epilogue == kAdd ? 1.0f : 0.0f;

  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  cublasLtHandle_t h = Handle(s, device, capturing);
  const int code = static_cast<int>(in) + (in != dt ? 1000 * static_cast<int>(dt) : 0);
  const ShapeKey key{m, n, k, code, epilogue, device};
  const void* w_scale = scales != nullptr ? Data(*scales->w) : nullptr;
  const void* x_scale = scales != nullptr ? Data(*scales->x) : nullptr;
  auto it = s.plans.find(key);
  if (it == s.plans.end()) {
    Plan p = MakePlan(dt, m, n, k, epilogue, bias, in);
    if (scales != nullptr) SetScales(p, w_scale, x_scale);
    const ShapeKey bucket{Bucket(m), n, k, code, epilogue, device};
    auto t = s.tuned.find(bucket);
    cublasLtMatmulHeuristicResult_t check{};
    if (t != s.tuned.end() && t->second.second <= ws_bytes &&
        cublasLtMatmulAlgoCheck(h, p.desc, p.a, p.b, p.c, p.c, &t->second.first, &check) ==
            CUBLAS_STATUS_SUCCESS &&
        check.workspaceSize <= ws_bytes) {
      p.algo = t->second.first;
      p.workspace = check.workspaceSize;
      p.timed = true;
    } else {
      auto cands = Candidates(h, p, ws_bytes, capturing ? 1 : kCandidates);
      TVM_FFI_CHECK(!cands.empty(), RuntimeError)
          << "cuBLASLt has no algorithm for [" << m << ", " << k << "] x [" << n << ", " << k << "]^T";
      p.algo = cands[0].algo;
      p.workspace = cands[0].workspaceSize;
      if (!capturing && TimeBest(h, &p, cands, o, beta, stream)) {
        p.timed = true;
        s.tuned[bucket] = {p.algo, p.workspace};
      }
    }
    it = s.plans.emplace(key, p).first;
  }
  Plan& p = it->second;
  if (scales != nullptr) SetScales(p, w_scale, x_scale);  // (pointers are part of the descriptor, as the bias's)
  if (epilogue == kBias) {  // the bias pointer is part of the descriptor
    MLCC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                     sizeof(bias)));
  }
  MLCC_CUBLAS_CHECK(Run(h, p, &p.algo, p.workspace, o, beta, stream));
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("mlcc.cublaslt.matmul",
           [](TensorView x, TensorView w, TensorView workspace, TensorView out) {
             Matmul(x, w, nullptr, kNone, workspace, out);
           })
      .def("mlcc.cublaslt.matmul_bias",
           [](TensorView x, TensorView w, TensorView bias, TensorView workspace, TensorView out) {
             Matmul(x, w, &bias, kBias, workspace, out);
           })
      .def("mlcc.cublaslt.matmul_add",
           [](TensorView x, TensorView w, TensorView residual, TensorView workspace, TensorView out) {
             Matmul(x, w, &residual, kAdd, workspace, out);
           })
      .def("mlcc.cublaslt.matmul_fp8",
           [](TensorView xq, TensorView x_scale, TensorView w, TensorView w_scale, TensorView workspace,
              TensorView out) {
             const Scales sc{&w_scale, &x_scale};
             Matmul(xq, w, nullptr, kNone, workspace, out, &sc);
           })
      .def("mlcc.cublaslt.matmul_fp8_bias",
           [](TensorView xq, TensorView x_scale, TensorView w, TensorView w_scale, TensorView bias,
              TensorView workspace, TensorView out) {
             const Scales sc{&w_scale, &x_scale};
             Matmul(xq, w, &bias, kBias, workspace, out, &sc);
           })
      .def("mlcc.cublaslt.matmul_fp8_add",
           [](TensorView xq, TensorView x_scale, TensorView w, TensorView w_scale, TensorView residual,
              TensorView workspace, TensorView out) {
             const Scales sc{&w_scale, &x_scale};
             Matmul(xq, w, &residual, kAdd, workspace, out, &sc);
           })
      .def("mlcc.cublaslt.init",
           [](int device) {
             State& s = state();
             std::lock_guard<std::mutex> lock(s.mu);
             MLCC_CUDA_CHECK(cudaSetDevice(device));
             Handle(s, device, false);
           })
      .def("mlcc.cublaslt.cache_size", []() -> int64_t {
        State& s = state();
        std::lock_guard<std::mutex> lock(s.mu);
        return static_cast<int64_t>(s.plans.size());
      });
}
