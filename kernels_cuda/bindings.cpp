// The one binding file: a small C ABI over the launchers, called from Python through ctypes (every signature
// is declared in pagednb/kernels/abi.py). It includes no torch header, so it compiles in about a second; Python
// passes data pointers, strides and the current CUDA stream, and this layer checks the configuration (dtype,
// head_dim, block size, head counts, alignment) before anything is launched. The tables of what the kernels
// take (dtype codes, head dims, size limits) are exported too: Python reads them rather than copying them.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <stdint.h>

#include "launchers.h"

using pagednb::AttnParams;

bool pagednb::pdl_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("PAGEDNB_PDL");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
      return false;
    return major >= 9;
  }();
  return on;
}

namespace {

// torch's names of the dtype codes, in DType order
constexpr const char* kDTypeNames[] = {"float32", "float16", "bfloat16"};
static_assert(sizeof(kDTypeNames) / sizeof(kDTypeNames[0]) == pagednb::kNumDTypes, "a name per dtype code");
static_assert(pagednb::kFloat32 == 0 && pagednb::kFloat16 == 1 && pagednb::kBFloat16 == 2, "codes index the names");

constexpr int kNumHeadDims = sizeof(pagednb::kHeadDims) / sizeof(pagednb::kHeadDims[0]);

bool supported_dtype(int dtype) { return dtype >= 0 && dtype < pagednb::kNumDTypes; }

bool supported_head_dim(int d) {
  for (int s : pagednb::kHeadDims)
    if (d == s) return true;
  return false;
}

int check_params(int dtype, int head_dim, const AttnParams* p) {
  if (p == nullptr || !supported_dtype(dtype) || !supported_head_dim(head_dim)) return -1;
  if (p->Hkv <= 0 || p->G <= 0 || p->H != p->Hkv * p->G) return -1;
  if (p->bs_log2 < 0 || p->bs_log2 > 12 || p->num_seqs <= 0) return -1;
  if (p->cache_fp8 && (dtype == pagednb::kFloat32 || !(p->k_scale > 0.f) || !(p->v_scale > 0.f))) return -1;
  return 0;
}

int64_t elem_size(int dtype) { return dtype == pagednb::kFloat32 ? 4 : 2; }

// Every pointer (nullptr passes) and byte count a multiple of 16: the fused ops move 16-byte vectors.
bool aligned16(std::initializer_list<const void*> ptrs, std::initializer_list<int64_t> bytes) {
  uint64_t all = 0;
  for (const void* p : ptrs) all |= reinterpret_cast<uint64_t>(p);
  for (int64_t b : bytes) all |= static_cast<uint64_t>(b);
  return all % 16 == 0;
}

// The fused MoE kernel's shapes: rows of whole 16-byte vectors, experts within the routing kernel's counters.
bool moe_shape_ok(int T, int H, int I, int E, int topk) {
  return T >= 0 && H > 0 && I > 0 && H % 8 == 0 && I % 8 == 0 && E >= 1 && E <= pagednb::kMoeMaxExperts &&
         topk >= 1 && topk <= E && (int64_t)T * topk <= INT32_MAX;
}

// Resident CTAs per SM of the kernel serving decode rows of this configuration: the row kernel (GMAX query
// heads per CTA), or the tensor-core one where group_mma_applies. Cached: one occupancy query each.
int resident_ctas(int dtype, int head_dim, int G, int variant, int cache_fp8) {
  static std::mutex mu;
  static int cache[2][3][3][5][4] = {};  // [fp8 cache][row kernel direct / ring, tensor cores][dtype][head_dim][GMAX]
  const bool mma = pagednb::group_mma_applies(dtype, head_dim, G, variant, cache_fp8);
  const int gmax = pagednb::row_gmax(G, cache_fp8);
  const int vi = mma ? 2 : variant != 0;  // row variants 1 and 2 are the same row kernel
  const int di = head_dim == 16 ? 0 : head_dim == 32 ? 1 : head_dim == 64 ? 2 : head_dim == 128 ? 3 : 4;
  const int gi = mma ? 0 : gmax == 1 ? 0 : gmax == 2 ? 1 : gmax == 4 ? 2 : 3;
  std::lock_guard<std::mutex> lock(mu);
  int& n = cache[cache_fp8 ? 1 : 0][vi][dtype][di][gi];
  if (n == 0) {
    if (mma)
      n = dtype == pagednb::kBFloat16 ? pagednb::occupancy_group_mma_bf16(head_dim, cache_fp8)
                                      : pagednb::occupancy_group_mma_f16(head_dim, cache_fp8);
    else
      n = dtype == pagednb::kFloat32   ? pagednb::occupancy_row_f32(head_dim, gmax, vi)
          : dtype == pagednb::kFloat16 ? pagednb::occupancy_row_f16(head_dim, gmax, vi, cache_fp8)
                                       : pagednb::occupancy_row_bf16(head_dim, gmax, vi, cache_fp8);
    if (n <= 0) n = 1;
  }
  return n;
}

// The GEMV's output checks: a gate (GemvGate) other than kGemvUngated takes the weight's rows as
// [gate (N/2) | up (N/2)] and writes out[M, N/2] = act(gate) * up.
bool gemv_out_ok(int N, int64_t out_stride, int gate) {
  if (gate < pagednb::kGemvUngated || gate > pagednb::kGemvGeluTanh) return false;
  return gate != pagednb::kGemvUngated ? N % 2 == 0 && out_stride >= N / 2 : out_stride >= N;
}

}  // namespace

extern "C" {

// Split-K plan for the row kernel (or the tensor-core decode kernel where group_mma_applies: one CTA per
// kv head then): rows = query rows it serves, range_max = the most tokens a row attends to, cache_fp8 = 1
// for an fp8 cache. No split when the (row, kv head) CTAs already fill 3/4 of one wave of resident CTAs;
// otherwise enough partitions (of >= 128 tokens) for about one full wave. A partition's CTA is latency-bound
// (batch 1, context 512: 7.4 us for 256 tokens on an H200), and each partition costs the merge one more read
// (decode.cuh: the last partition to finish merges; partitions past a row's keys exit at once).
int pagednb_row_plan(int dtype, int head_dim, int G, int Hkv, int rows, int range_max, int num_sms,
                     int variant, int cache_fp8, int* P, int* part_size, int* head_groups) {
  if (!supported_dtype(dtype) || !supported_head_dim(head_dim) || G <= 0 || Hkv <= 0) return -1;
  if (cache_fp8 && dtype == pagednb::kFloat32) return -1;
  cache_fp8 = cache_fp8 ? 1 : 0;
  const bool mma = pagednb::group_mma_applies(dtype, head_dim, G, variant, cache_fp8);
  const int gmax = mma ? G : pagednb::row_gmax(G, cache_fp8);
  *head_groups = (G + gmax - 1) / gmax;
  range_max = range_max < 1 ? 1 : range_max;
  const int kvc = mma ? 1 : pagednb::row_kv_per_cta(G, head_dim, Hkv, cache_fp8, variant);
  const int64_t base = (int64_t)(rows < 1 ? 1 : rows) * (Hkv / kvc) * *head_groups;
  const int64_t wave = (int64_t)resident_ctas(dtype, head_dim, G, variant, cache_fp8) * (num_sms < 1 ? 1 : num_sms);
  int64_t parts = 4 * base >= 3 * wave ? 1 : (wave + base - 1) / base;
  const int64_t max_parts = (range_max + 127) / 128;
  if (parts > max_parts) parts = max_parts;
  if (parts > 1024) parts = 1024;
  if (parts < 1) parts = 1;
  int size = (int)((range_max + parts - 1) / parts);
  size = (size + 63) / 64 * 64;
  *part_size = size;
  *P = (range_max + size - 1) / size;
  return 0;
}

// 1 where decode rows of this configuration run on the tensor-core kernel, 0 on the row kernel (tests and
// benchmarks ask; both follow AttnParams.row_order).
int pagednb_decode_tensor_cores(int dtype, int head_dim, int G, int variant, int cache_fp8) {
  return pagednb::group_mma_applies(dtype, head_dim, G, variant, cache_fp8) ? 1 : 0;
}

// 1 where a decode launch of this configuration can fuse the step's q/k norm + rotary embedding and cache write
// (AttnParams.fuse_rope; softcap: 1 where the layer soft-caps its scores).
int pagednb_decode_fuses_rope(int dtype, int head_dim, int G, int variant, int cache_fp8, int softcap) {
  return pagednb::decode_fuses_rope(dtype, head_dim, G, variant, cache_fp8, softcap) ? 1 : 0;
}

// Resident CTAs per SM of the kernel serving decode rows of this configuration (the tensor-core fp8 kernel counts a
// CTA per kv head): the backend sizes a wave with it.
int pagednb_decode_resident_ctas(int dtype, int head_dim, int G, int variant, int cache_fp8) {
  if (!supported_dtype(dtype) || !supported_head_dim(head_dim) || G <= 0) return -1;
  return resident_ctas(dtype, head_dim, G, variant, cache_fp8 ? 1 : 0);
}

int pagednb_row_attention(int dtype, int head_dim, const AttnParams* p, void* stream) {
  if (check_params(dtype, head_dim, p) != 0 || p->P < 1 || p->part_size < 1 || p->head_groups < 1) return -1;
  if (p->fuse_rope) {  // one row per sequence (its token), on a kernel that fuses, its inputs in 16-byte vectors
    if (p->num_rows != p->num_seqs || p->k_new == nullptr || p->v_new == nullptr ||
        p->rope_cos == nullptr || p->rope_sin == nullptr || p->slots == nullptr ||
        (p->q_norm_weight == nullptr) != (p->k_norm_weight == nullptr) ||
        !pagednb::decode_fuses_rope(dtype, head_dim, p->G, p->row_variant, p->cache_fp8, p->softcap_log2 > 0.f))
      return -1;
    const int64_t es = elem_size(dtype);
    if (!aligned16({p->q, p->k_new, p->v_new, p->rope_cos, p->rope_sin, p->q_norm_weight, p->k_norm_weight},
                   {p->q_stride_tok * es, p->q_stride_head * es, p->k_stride_tok * es, p->k_stride_head * es,
                    p->v_stride_tok * es, p->v_stride_head * es, p->cos_sin_stride * es}))
      return -1;
  }
  if (p->num_rows <= 0) return 0;
  switch (dtype) {
    case pagednb::kFloat32: return pagednb::launch_row_f32(head_dim, *p, stream);
    case pagednb::kFloat16: return pagednb::launch_row_f16(head_dim, *p, stream);
    default: return pagednb::launch_row_bf16(head_dim, *p, stream);
  }
}

int pagednb_prefill_attention(int dtype, int head_dim, const AttnParams* p, void* stream) {
  if (check_params(dtype, head_dim, p) != 0 || dtype == pagednb::kFloat32) return -1;
  return dtype == pagednb::kFloat16 ? pagednb::launch_prefill_f16(head_dim, *p, stream)
                                    : pagednb::launch_prefill_bf16(head_dim, *p, stream);
}

// Resident prefill CTAs per SM for (dtype, head_dim): the benchmark reports it.
int pagednb_prefill_occupancy(int dtype, int head_dim) {
  if (dtype != pagednb::kFloat16 && dtype != pagednb::kBFloat16) return -1;
  if (!supported_head_dim(head_dim)) return -1;
  return dtype == pagednb::kFloat16 ? pagednb::occupancy_prefill_f16(head_dim)
                                    : pagednb::occupancy_prefill_bf16(head_dim);
}

// fp8_dtype -1: the cache has key/value's dtype (bytes copied, row_bytes per row); a bf16/fp16 code: the cache
// is fp8 and rows of row_bytes / 2 such values are stored as fp8(k / k_scale), fp8(v / v_scale).
int pagednb_write_kv(const void* key, const void* value, int64_t k_stride_tok, int64_t v_stride_tok,
                     void* cache, int64_t v_offset_bytes, const int64_t* slots, int num_tokens,
                     int64_t row_bytes, int fp8_dtype, float k_scale, float v_scale, void* stream) {
  if (row_bytes <= 0 || row_bytes % 2 != 0) return -1;
  if (fp8_dtype >= 0) {
    if ((fp8_dtype != pagednb::kFloat16 && fp8_dtype != pagednb::kBFloat16) || (row_bytes / 2) % 8 != 0 ||
        row_bytes / 2 > INT32_MAX || !(k_scale > 0.f) || !(v_scale > 0.f))
      return -1;
    return pagednb::launch_write_kv_fp8(fp8_dtype, key, value, k_stride_tok, v_stride_tok, cache, v_offset_bytes,
                                        slots, num_tokens, (int)(row_bytes / 2), k_scale, v_scale, stream);
  }
  return pagednb::launch_write_kv(key, value, k_stride_tok, v_stride_tok, cache, v_offset_bytes, slots,
                                  num_tokens, row_bytes, stream);
}

// ---- fused elementwise ops (fused_ops.cu): element strides, 16-byte aligned rows ------------------------
int pagednb_rms_norm(int dtype, void* out, void* residual_out, const void* x, int64_t x_stride,
                     const void* residual, int64_t residual_stride, const void* weight, int rows, int hidden,
                     float eps, float weight_offset, int weight_in_float32, void* stream) {
  if (!supported_dtype(dtype) || hidden <= 0 || rows < 0) return -1;
  if (residual != nullptr && residual_out == nullptr) return -1;
  const int64_t es = elem_size(dtype);
  if (hidden * es > pagednb::kMaxNormRowBytes) return -1;
  if (!aligned16({out, residual_out, x, residual, weight}, {x_stride * es, residual_stride * es, hidden * es}))
    return -1;
  pagednb::RmsNormArgs a{out,      residual_out, x,      residual, weight, x_stride,
                         residual_stride, rows, hidden, eps, {weight_offset, weight_in_float32}};
  return pagednb::launch_rms_norm(dtype, a, stream);
}

// v == nullptr: q and k only; otherwise k (after the rotary embedding) and v are also written into the paged
// cache at slots (see QkRopeArgs).
int pagednb_qk_norm_rope(int dtype, void* q, int64_t q_stride_tok, int64_t q_stride_head, void* k,
                         int64_t k_stride_tok, int64_t k_stride_head, const void* cos, const void* sin,
                         int64_t cos_sin_stride, const void* q_weight, const void* k_weight, int num_tokens,
                         int num_heads, int num_kv_heads, int head_dim, float eps, float weight_offset,
                         int weight_in_float32, const void* v, int64_t v_stride_tok,
                         int64_t v_stride_head, void* cache, int64_t cache_v_offset, const int64_t* slots,
                         int cache_fp8, float k_scale, float v_scale, void* stream) {
  if (!supported_dtype(dtype) || !supported_head_dim(head_dim) || num_tokens < 0 || num_heads <= 0 ||
      num_kv_heads <= 0 || (q_weight == nullptr) != (k_weight == nullptr))
    return -1;
  if (v != nullptr && (cache == nullptr || slots == nullptr || cache_v_offset <= 0)) return -1;
  if (cache_fp8 && (dtype == pagednb::kFloat32 || !(k_scale > 0.f) || !(v_scale > 0.f))) return -1;
  const int64_t es = elem_size(dtype);
  if (!aligned16({q, k, cos, sin, q_weight, k_weight, v, cache},
                 {q_stride_tok * es, q_stride_head * es, k_stride_tok * es, k_stride_head * es, cos_sin_stride * es,
                  v_stride_tok * es, v_stride_head * es, cache_v_offset * (cache_fp8 ? 1 : es)}))
    return -1;
  pagednb::QkRopeArgs a{q, k, q_stride_tok, q_stride_head, k_stride_tok, k_stride_head, cos, sin, cos_sin_stride,
                        q_weight, k_weight, num_tokens, num_heads, num_kv_heads, head_dim, eps,
                        {weight_offset, weight_in_float32}, v, v_stride_tok, v_stride_head, cache, cache_v_offset,
                        slots, cache_fp8 ? 1 : 0, k_scale, v_scale};
  return pagednb::launch_qk_norm_rope(dtype, a, stream);
}

// act(gate) * up, act by its GemvGate code: SiLU (1) or GELU-tanh (2)
int pagednb_gate_and_mul(int dtype, int gate, void* out, const void* gate_up, int64_t stride, int rows, int inter,
                         void* stream) {
  if (!supported_dtype(dtype) || inter <= 0 || rows < 0) return -1;
  if (gate != pagednb::kGemvSilu && gate != pagednb::kGemvGeluTanh) return -1;
  const int64_t es = elem_size(dtype);
  if (!aligned16({out, gate_up}, {stride * es, inter * es})) return -1;
  return pagednb::launch_gate_and_mul(dtype, gate, out, gate_up, stride, rows, inter, stream);
}

// ---- temperature sampling (sampling.cu): logits float32/fp16/bf16, the rest float32, element strides ----------
int pagednb_sample_temperature(int logits_dtype, const void* logits, int64_t row_stride, const float* temperature,
                               int64_t t_stride, const float* uniforms, int64_t u_stride, int64_t* out, int rows,
                               int vocab, void* stream) {
  if (!supported_dtype(logits_dtype) || rows < 0 || vocab <= 0 || vocab > pagednb::kMaxSampleVocab ||
      row_stride < 0 || t_stride < 0 || u_stride < 0)
    return -1;
  if (rows > 0 && (logits == nullptr || temperature == nullptr || uniforms == nullptr || out == nullptr)) return -1;
  pagednb::SampleArgs a{logits, logits_dtype, row_stride, temperature, t_stride, uniforms, u_stride, out, rows, vocab};
  return pagednb::launch_sample_temperature(a, stream);
}

int pagednb_sample_greedy(int logits_dtype, const void* logits, int64_t row_stride, int64_t* out, int rows, int vocab,
                          void* stream) {
  if (!supported_dtype(logits_dtype) || rows < 0 || vocab <= 0 || row_stride < 0) return -1;
  if (rows > 0 && (logits == nullptr || out == nullptr)) return -1;
  pagednb::GreedyArgs a{logits, logits_dtype, row_stride, out, rows, vocab};
  return pagednb::launch_sample_greedy(a, stream);
}

// ---- a structured-output grammar's bitmask applied to the logits in place (sampling.cu) ------------------------
int pagednb_mask_logits(int logits_dtype, void* logits, int64_t row_stride, const void* bitmask, int64_t mask_stride,
                        int rows, int vocab, void* stream) {
  if (!supported_dtype(logits_dtype) || rows < 0 || vocab <= 0 || row_stride < 0 || rows > 65535 ||
      mask_stride < (vocab + 31) / 32)
    return -1;
  if (rows > 0 && (logits == nullptr || bitmask == nullptr)) return -1;
  pagednb::MaskArgs a{logits, logits_dtype, row_stride, bitmask, mask_stride, rows, vocab};
  return pagednb::launch_mask_logits(a, stream);
}

// Whether the kernels are launched with programmatic dependent launch (common.cuh): sm_90+, PAGEDNB_PDL != 0.
int pagednb_pdl_enabled() { return pagednb::pdl_enabled() ? 1 : 0; }

// ---- small-batch linear (gemv.cu): bf16 / fp16, element strides; gate: see gemv_out_ok -------------------------
int pagednb_gemv(int dtype, void* out, int64_t out_stride, const void* x, int64_t x_stride, const void* weight,
                 const void* bias, int M, int N, int K, int gate, void* stream) {
  if (dtype != pagednb::kFloat16 && dtype != pagednb::kBFloat16) return -1;
  if (M < 0 || M > pagednb::kGemvMaxRows || N < 0 || K <= 0 || K % 8 != 0 || x_stride < K ||
      !gemv_out_ok(N, out_stride, gate))
    return -1;
  if (!aligned16({x, weight}, {x_stride * 2})) return -1;
  pagednb::GemvArgs a{out, x, weight, bias, x_stride, out_stride, M, N, K, pagednb::kGemvPlain, gate};
  return pagednb::launch_gemv(dtype, a, stream);
}

// The product with RMSNorm(x + residual) as its input rows (residual nullptr: RMSNorm(x)), x + residual also
// written to residual_out [M, K] (dense); the norm as pagednb_rms_norm takes it. K <= kGemvMaxNormWidth;
// gate as pagednb_gemv.
int pagednb_gemv_rms_norm(int dtype, void* out, int64_t out_stride, const void* x, int64_t x_stride,
                          const void* residual, int64_t residual_stride, void* residual_out, const void* norm_weight,
                          float eps, float weight_offset, int weight_in_float32, const void* weight, const void* bias,
                          int M, int N, int K, int gate, void* stream) {
  if (dtype != pagednb::kFloat16 && dtype != pagednb::kBFloat16) return -1;
  if (M < 0 || M > pagednb::kGemvMaxRows || N < 0 || K <= 0 || K % 8 != 0 || K > pagednb::kGemvMaxNormWidth ||
      x_stride < K || !gemv_out_ok(N, out_stride, gate) || norm_weight == nullptr ||
      (residual != nullptr && residual_out == nullptr))
    return -1;
  if (!aligned16({x, weight, residual, residual_out, norm_weight}, {x_stride * 2, residual_stride * 2})) return -1;
  pagednb::GemvArgs a{out,      x,           weight, bias, x_stride, out_stride, M, N, K, pagednb::kGemvRmsNorm,
                      gate, residual, residual_out, norm_weight, residual_stride, eps,
                      {weight_offset, weight_in_float32}};
  return pagednb::launch_gemv(dtype, a, stream);
}

// ---- fused mixture-of-experts MLP (moe.cu): bf16 / fp16; int64 expert ids, weights float32 or the model's ---
// Bytes of scratch pagednb_fused_moe needs for this shape; -1 for a shape it does not take.
int64_t pagednb_moe_workspace_bytes(int T, int H, int I, int E, int topk) {
  return moe_shape_ok(T, H, I, E, topk) ? pagednb::moe_workspace_bytes(T, H, I, E, topk) : -1;
}

int pagednb_fused_moe(int dtype, void* out, const void* hidden, int64_t hidden_stride, const void* w13,
                      const void* w2, const int64_t* topk_ids, const void* topk_weights, int weights_dtype,
                      void* workspace, int T, int H, int I, int E, int topk, void* stream) {
  if (dtype != pagednb::kFloat16 && dtype != pagednb::kBFloat16) return -1;
  if (weights_dtype != pagednb::kFloat32 && weights_dtype != dtype) return -1;
  if (!moe_shape_ok(T, H, I, E, topk) || hidden_stride < H) return -1;
  if (T > 0 && (out == nullptr || hidden == nullptr || w13 == nullptr || w2 == nullptr || topk_ids == nullptr ||
                topk_weights == nullptr || workspace == nullptr))
    return -1;
  if (!aligned16({out, hidden, w13, w2, workspace}, {hidden_stride * 2})) return -1;
  pagednb::FusedMoeArgs a{out, hidden, hidden_stride, w13, w2, topk_ids, topk_weights, weights_dtype, workspace,
                          T, H, I, E, topk};
  return pagednb::launch_fused_moe(dtype, a, stream);
}

// The router's top-k experts and their weights from router logits (bf16 / fp16); weights in the logits' dtype
// when round_weights, else float32; ids int64.
int pagednb_moe_select_experts(int dtype, const void* logits, int64_t row_stride, void* weights, int64_t* ids, int T,
                               int E, int topk, int renormalize, int round_weights, void* stream) {
  if (dtype != pagednb::kFloat16 && dtype != pagednb::kBFloat16) return -1;
  if (T < 0 || E < 1 || E > pagednb::kMoeMaxExperts || topk < 1 || topk > E || topk > pagednb::kMoeMaxTopK ||
      row_stride < E)
    return -1;
  if (T > 0 && (logits == nullptr || weights == nullptr || ids == nullptr)) return -1;
  pagednb::MoeSelectArgs a{logits, row_stride, weights, ids, T, E, topk, renormalize != 0, round_weights != 0};
  return pagednb::launch_moe_select_experts(dtype, a, stream);
}

// ---- the tables of what the kernels take, read by pagednb/kernels/abi.py ------------------------------------
// torch's name of a dtype code ("bfloat16"); nullptr past the last code.
const char* pagednb_dtype_name(int code) { return supported_dtype(code) ? kDTypeNames[code] : nullptr; }

// The index-th supported head_dim, ascending; 0 past the last.
int pagednb_head_dim(int index) { return index >= 0 && index < kNumHeadDims ? pagednb::kHeadDims[index] : 0; }

int64_t pagednb_max_norm_row_bytes() { return pagednb::kMaxNormRowBytes; }
int pagednb_max_sample_vocab() { return pagednb::kMaxSampleVocab; }
int pagednb_gemv_max_rows() { return pagednb::kGemvMaxRows; }
int pagednb_gemv_max_norm_width() { return pagednb::kGemvMaxNormWidth; }
int pagednb_moe_max_experts() { return pagednb::kMoeMaxExperts; }
int pagednb_moe_max_topk() { return pagednb::kMoeMaxTopK; }

int pagednb_params_size() { return (int)sizeof(AttnParams); }

const char* pagednb_error_string(int code) {
  if (code == -1) return "unsupported configuration";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"
