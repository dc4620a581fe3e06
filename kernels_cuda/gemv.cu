// y[M, N] = x[M, K] . W[N, K]^T (+ bias) for the one or two rows of a small decode step: the
// weight-streaming matrix-vector product. At M = 1 cuBLAS reads a small decoder's projections at
// 0.3-2 TB/s on an H200 (its GEMM tiles are built for many rows); this kernel streams each weight row
// once with 16-byte loads, keeps many of them in flight, and reuses each loaded weight vector for all M
// rows. Which shapes it serves is decided in pagednb/model/small_linear.py from benchmarks/linear.py.
//
// Layout: a CTA of 4 warps. K is cut into chunks of 256 elements (32 lanes x 8, 16 bytes per lane).
// Wide matrices (N >= 4096: the fused qkv and gate/up projections, the LM head): each warp owns R whole
// weight rows and walks all their chunks, U chunks' loads issued before their math. Narrow ones
// (o_proj, down_proj: too few rows to fill the GPU otherwise): the 4 warps share one row and take
// every 4th chunk. Each lane accumulates in float32; a warp then reduces its M x R sums across lanes
// with a reduce-scatter butterfly (31 shuffles for 32 sums instead of 160), ending with one total per
// lane group; the 4 warps of a shared row add their totals in warp order.
//
// Numerics: float32 accumulation, one rounding to the output dtype (as cuBLAS), bias added in float32
// before it. The order of the additions for one output element depends only on N and K (which layout,
// which chunks), never on M, R or the batch around the row, so a row's result is the same whether it
// runs alone, beside another row, or in a padded CUDA-graph bucket.
#include "common.cuh"
#include "launchers.h"

namespace pagednb {

namespace {

constexpr int kGemvWarps = 4;
constexpr int kGemvChunk = 32 * 8;  // elements of K per warp step: 16 bytes per lane
constexpr int kGemvUnroll = 4;      // chunks whose loads a warp issues before their math

__host__ __device__ constexpr int log2i(int v) { return v <= 1 ? 0 : 1 + log2i(v / 2); }

// Sums v[i] over the warp's 32 lanes for all V (a power of two <= 32) values at once. Each level halves
// the values a lane carries (it keeps one half, sends the other to its partner) until one is left, then
// plain butterfly levels follow. Lane l ends with the total of value l >> (5 - log2 V). Every level
// adds the same pairs of lanes as a plain butterfly would, so each total is the same bits as a
// butterfly's, whatever V is.
template <int V>
__device__ __forceinline__ float warp_reduce_scatter(float (&v)[V], int lane) {
#pragma unroll
  for (int s = 16, n = V; s >= 1; s >>= 1) {
    if (n > 1) {
      const bool upper = lane & s;
#pragma unroll
      for (int i = 0; i < n / 2; ++i) {
        const float send = upper ? v[i] : v[i + n / 2];
        const float keep = upper ? v[i + n / 2] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, s);
      }
      n /= 2;
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], s);
    }
  }
  return v[0];
}

// WK warps share each group of R rows (WK = 1: a warp's own rows; WK = 4: all 4 warps on one row).
template <typename T, int MM, int R, int WK>
__global__ void __launch_bounds__(kGemvWarps * 32) gemv_kernel(const GemvArgs a) {
  constexpr int V = MM * R, GROUPS = kGemvWarps / WK;
  static_assert(V <= 32 && (V & (V - 1)) == 0, "M x R must be a power of two <= 32");
  __shared__ float partial[WK > 1 ? kGemvWarps : 1][V];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = warp / WK, ks = warp % WK;
  const int n0 = (blockIdx.x * GROUPS + group) * R;
  const T* x = static_cast<const T*>(a.x);
  const T* wrow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wrow[r] = static_cast<const T*>(a.weight) + (int64_t)min(n0 + r, a.N - 1) * a.K;

  float acc[V];
#pragma unroll
  for (int i = 0; i < V; ++i) acc[i] = 0.f;

  const int nchunks = (a.K + kGemvChunk - 1) / kGemvChunk;
  for (int c0 = ks; c0 < nchunks; c0 += WK * kGemvUnroll) {
    uint4 w[kGemvUnroll][R];
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const int k = (c0 + u * WK) * kGemvChunk + lane * 8;
#pragma unroll
      for (int r = 0; r < R; ++r) w[u][r] = k < a.K ? ldg16(wrow[r] + k) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const int k = (c0 + u * WK) * kGemvChunk + lane * 8;
      if (k >= a.K) break;  // later u are past the end too
      float wf[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) Elem<T>::unpack(w[u][r], wf[r]);
#pragma unroll
      for (int m = 0; m < MM; ++m) {
        if (m < a.M) {
          float xf[8];
          Elem<T>::unpack(ldg16(x + (int64_t)m * a.x_stride + k), xf);
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[m * R + r] = fmaf(xf[e], wf[r][e], acc[m * R + r]);
        }
      }
    }
  }

  float total = warp_reduce_scatter<V>(acc, lane);
  const int idx = lane >> (5 - log2i(V));              // the value this lane holds
  const bool holder = (lane & ((32 / V) - 1)) == 0;     // one lane per value writes it
  if constexpr (WK > 1) {
    if (holder) partial[warp][idx] = total;
    __syncthreads();
    if (ks != 0) return;
#pragma unroll
    for (int i = 1; i < WK; ++i) total += partial[warp + i][idx];  // warp order
  }
  const int m = idx / R, n = n0 + idx % R;
  if (holder && m < a.M && n < a.N) {
    if (a.bias != nullptr) total += Elem<T>::to_float(static_cast<const T*>(a.bias)[n]);
    static_cast<T*>(a.out)[(int64_t)m * a.out_stride + n] = Elem<T>::from_float(total);
  }
}

template <typename T, int MM, int R, int WK>
int launch_gemv_shape(const GemvArgs& a, cudaStream_t st) {
  constexpr int rows_per_cta = kGemvWarps / WK * R;
  const unsigned blocks = (unsigned)((a.N + rows_per_cta - 1) / rows_per_cta);
  gemv_kernel<T, MM, R, WK><<<blocks, kGemvWarps * 32, 0, st>>>(a);
  return (int)cudaGetLastError();
}

template <typename T, int MM>
int launch_gemv_rows(const GemvArgs& a, cudaStream_t st) {
  // the layout depends on N only (never on M), so a row's sums are the same for every batch size
  return a.N >= 4096 ? launch_gemv_shape<T, MM, 2, 1>(a, st) : launch_gemv_shape<T, MM, 1, 4>(a, st);
}

template <typename T>
int launch_gemv_dtype(const GemvArgs& a, cudaStream_t st) {
  static_assert(kGemvMaxRows == 2, "one instantiation per row count");
  return a.M <= 1 ? launch_gemv_rows<T, 1>(a, st) : launch_gemv_rows<T, 2>(a, st);
}

}  // namespace

int launch_gemv(int dtype, const GemvArgs& a, void* stream) {
  if (a.M <= 0 || a.N <= 0) return 0;  // the shape is checked by bindings.cpp
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kFloat16: return launch_gemv_dtype<__half>(a, st);
    case kBFloat16: return launch_gemv_dtype<__nv_bfloat16>(a, st);
    default: return -1;
  }
}

}  // namespace pagednb
