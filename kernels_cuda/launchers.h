// Host-side launchers of the kernels, shared by the .cu files and bindings.cpp.
// Raw pointers and plain integers only: no torch or CUDA headers needed to include this.
#pragma once

#include <stdint.h>

namespace pagednb {

// dtype codes of the C ABI; Python reads them by name (pagednb_dtype_name in bindings.cpp)
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
constexpr int kNumDTypes = 3;

// The head dims the attention and q/k-norm kernels are instantiated for (the head_dim switches of decode.cuh,
// prefill.cuh and fused_ops.cu); Python reads them through pagednb_head_dim (bindings.cpp).
constexpr int kHeadDims[] = {16, 32, 64, 128, 256};

// Attention over the paged cache for a flattened ("varlen") batch. Element strides.
struct AttnParams {
  const void* q;             // [num_tokens, H, D]; q_stride_tok / q_stride_head in elements, last dim dense
  int64_t q_stride_tok, q_stride_head;
  const void* cache;         // [2, num_blocks, block_size, Hkv, D], dense
  int64_t v_offset;          // elements between the K and V halves: num_blocks * block_size * Hkv * D
  void* out;                 // [num_tokens, H, D], dense
  float* part_o;             // split-K partials [num_tokens, H, P, D] (row kernel, P > 1)
  float* part_ml;            // [num_tokens, H, P, 2]: running max (log2 units) and sum
  int* part_count;           // [num_tokens, decode CTAs per row]: partitions done, zero between launches (P > 1)
  const int* qsl;            // [num_seqs + 1]
  const int* seq_lens;       // [num_seqs]
  const int* block_tables;   // [num_seqs, bt_stride]
  const int64_t* row_order;  // row kernel: its rows in launch order (longest first); nullptr: 0, 1, 2, ...
  int bt_stride;
  int num_seqs, num_rows;    // num_rows: rows of the row-kernel grid (num_tokens)
  int H, Hkv, G;             // G = H / Hkv
  int head_groups;           // row kernel: CTAs per kv head (ceil(G / GMAX))
  int bs_log2;               // block size is 1 << bs_log2
  int window;                // 0: none
  int part_size, P;          // row kernel split-K: tokens per partition, partitions
  int decode_only;           // row kernel: only rows of sequences with query_len == 1
  int max_query_len;         // prefill kernel: rows of the longest chunk
  int max_tiles;             // prefill kernel: set by the launcher (ceil(max_query_len / BM))
  float scale_log2;          // softmax scale * log2(e)
  int row_variant;           // row kernel: 2 = tensor cores for large GQA groups where group_mma_applies, else
                             // as 1; 3 = as 2, with two kv heads per CTA where row_kv_per_cta; 4 = as 2, with
                             // tensor cores for an fp8 cache from 2 heads (group_mma_applies); 5 (the backend's
                             // default) = as 4, the fp8 two-head CTA's lean ring at head_dim 128 (GroupFp8Cfg);
                             // 1 = cp.async ring (16-bit types); 0 = direct loads
  float softcap_log2;        // attention logit soft-capping (Gemma 2) in log2 units, softcap * log2(e); 0: none
  int cache_fp8;             // 1: the cache holds float8 e4m3, fp8(x / scale) (common.cuh); 0: the query's dtype
  float k_scale, v_scale;    // an fp8 cache's per-layer scales (keys read as fp8 * k_scale); 1 otherwise
  int early_keys;            // decode kernels: 1 = row lookup, row_order and the keys of earlier steps read before
                             // griddepcontrol.wait (decode.cuh, Keys); 0 = after it (the launch right behind the
                             // step's sort, or PAGEDNB_EARLY_KEYS=0)
  // fuse_rope 1: the step's q/k RMSNorm + rotary embedding and K/V cache write happen in the decode kernel's
  // prologue (decode.cuh, FusedRope) instead of a launch of their own: a decode-only step (row r is token r) whose
  // q holds the raw projections; only where decode_fuses_rope says so. The fields below are its inputs, as
  // QkRopeArgs names them.
  int fuse_rope;
  const void* k_new;         // [num_tokens, Hkv, D] raw k and v rows, last dim dense, 16-byte aligned strides
  const void* v_new;
  int64_t k_stride_tok, k_stride_head, v_stride_tok, v_stride_head;
  const void* rope_cos;      // [num_tokens, D] rows at token stride cos_sin_stride (rope_sin the same)
  const void* rope_sin;
  int64_t cos_sin_stride;
  const void* q_norm_weight; // [D] each; both nullptr: the rotary embedding only
  const void* k_norm_weight;
  float norm_eps, norm_offset;  // norm_offset, norm_in_float32: the norms' NormWeight
  int norm_in_float32;
  const int64_t* slots;      // [num_tokens] the cache slot of each row's new token (-1: not written)
};

// The tensor-core decode kernel (decode_group_mma.cuh) serves the rows of 16-bit models with 4 to 16 query
// heads per kv head at head_dim 64 (Llama 3.2 1B/3B), under row variants 2-4: there the row kernel is
// instruction-bound (benchmarks/NOTES.md). At head_dim 128 the row kernel already reads 16-bit K/V at ~4 TB/s and
// keeps them. Over an fp8 cache the row kernel does twice the multiply-adds per byte read (plus the
// conversions), so the tensor-core kernel serves head_dim 128 as well: from 4 heads per kv head under variants 2
// and 3, from 2 under variants 4 and 5 (the backend's default since issue 19's ninth round: with Qwen3-0.6B's 2 heads
// per kv head the row kernel spends ~4 instructions per fp8 byte; the tensor-core kernel, launched longest first,
// ran the standard workload 5.9% faster). Bindings (split plan) and launchers (dispatch) both ask this function.
inline bool group_mma_applies(int dtype, int head_dim, int G, int row_variant, int cache_fp8) {
  const int min_group = (row_variant == 4 || row_variant == 5) && cache_fp8 && head_dim == 128 ? 2 : 4;
  return row_variant >= 2 && (dtype == kFloat16 || dtype == kBFloat16) && G >= min_group && G <= 16 &&
         (head_dim == 64 || (cache_fp8 && head_dim == 128));
}

// Whether a decode launch can take the step's q/k norm + rotary embedding and cache write (AttnParams.fuse_rope):
// the tensor-core kernel over an fp8 cache (the fp8 target's path), without soft-capping. Its prologue takes the place
// of qk_norm_rope's launch, which cost a launch and its drain per layer (benchmarks/NOTES.md, issue 19's 15th round).
inline bool decode_fuses_rope(int dtype, int head_dim, int G, int row_variant, int cache_fp8, int softcap) {
  return cache_fp8 && !softcap && group_mma_applies(dtype, head_dim, G, row_variant, cache_fp8);
}

// Whether the launchers ask for programmatic dependent launch (common.cuh's launch_pdl): the current device is
// sm_90 or later and PAGEDNB_PDL is not "0" (read once per process, for A/B runs). Defined in bindings.cpp.
bool pdl_enabled();
// Query heads per row-kernel CTA (its GMAX). An fp8 cache's lanes hold 16 elements of each head (q and the
// accumulator in registers: twice a 16-bit cache's), so it stops at 4 heads per CTA rather than spill.
inline int row_gmax(int G, int cache_fp8) { return G <= 1 ? 1 : G <= 2 ? 2 : G <= 4 || cache_fp8 ? 4 : 8; }
// kv heads per row-kernel CTA: 2 under row variant 3 for an fp8 cache at head_dim 128 with at most 2 query
// heads per kv head (Qwen3-0.6B), else 1. A CTA's two adjacent kv heads are one 256-byte row per token (a bf16
// CTA's row): half the CTAs, each with twice the bytes to spread its fixed costs over (the row lookup, the
// queries, the ring's first loads, the merge), but twice as long a drain at the end of a launch. Not the
// default: the one whole run with it measured 32,753 tok/s against 33,906 without (benchmarks/NOTES.md, issue
// 19, seventh round); `kernels.py --only workload --plans engine,variant:3` is its A/B.
inline int row_kv_per_cta(int G, int head_dim, int Hkv, int cache_fp8, int row_variant) {
  return cache_fp8 && head_dim == 128 && G <= 2 && Hkv % 2 == 0 && row_variant == 3 ? 2 : 1;
}

// Each launcher returns 0 or a CUDA error code (cudaError_t as int); -1: unsupported configuration.
// Row (decode / float32) kernel, one definition per dtype file (decode_<dtype>.cu):
int launch_row_f32(int head_dim, const AttnParams& p, void* stream);
int launch_row_f16(int head_dim, const AttnParams& p, void* stream);
int launch_row_bf16(int head_dim, const AttnParams& p, void* stream);
int occupancy_row_f32(int head_dim, int gmax, int variant);  // resident CTAs per SM
int occupancy_row_f16(int head_dim, int gmax, int variant, int cache_fp8);
int occupancy_row_bf16(int head_dim, int gmax, int variant, int cache_fp8);
int occupancy_group_mma_f16(int head_dim, int cache_fp8);  // resident CTAs per SM of the tensor-core decode kernel
int occupancy_group_mma_bf16(int head_dim, int cache_fp8);
// Tensor-core prefill kernel (prefill_<dtype>.cu):
int launch_prefill_f16(int head_dim, const AttnParams& p, void* stream);
int launch_prefill_bf16(int head_dim, const AttnParams& p, void* stream);
int occupancy_prefill_f16(int head_dim);  // resident CTAs per SM (benchmarks)
int occupancy_prefill_bf16(int head_dim);

int launch_write_kv(const void* key, const void* value, int64_t k_stride_tok, int64_t v_stride_tok,
                    void* cache, int64_t v_offset_bytes, const int64_t* slots, int num_tokens,
                    int64_t row_bytes, void* stream);
// The same into an fp8 cache: key/value rows of row_elems bf16/fp16 values (dtype; byte strides, 16-byte
// aligned, row_elems a multiple of 8) stored as fp8(k / k_scale), fp8(v / v_scale).
int launch_write_kv_fp8(int dtype, const void* key, const void* value, int64_t k_stride_tok, int64_t v_stride_tok,
                        void* cache, int64_t v_offset_bytes, const int64_t* slots, int num_tokens, int row_elems,
                        float k_scale, float v_scale, void* stream);

// ---- fused elementwise ops (fused_ops.cu) ----------------------------------------------------------------
// Element strides; every row start, stride and length is a multiple of 16 bytes.

// The RMSNorm kernel keeps a row in registers: up to 8 vectors of 16 bytes for each of 512 threads.
constexpr int64_t kMaxNormRowBytes = 8 * 512 * 16;
// How a norm applies its weight w to h = x * rsqrt(mean(x^2) + eps) (float32): in_float32 0 (Llama):
// round(w * round(h)); 1: round(h * (w + offset)), OLMo 2 (offset 0) and Gemma (offset 1, its (1 + w)).
struct NormWeight {
  float offset;
  int in_float32;
};

struct RmsNormArgs {
  void* out;                 // [rows, hidden], dense
  void* residual_out;        // [rows, hidden], dense: x + residual (unused without a residual)
  const void* x;             // [rows, hidden], row stride x_stride
  const void* residual;      // nullptr: plain RMSNorm
  const void* weight;        // [hidden]
  int64_t x_stride, residual_stride;
  int rows, hidden;
  float eps;
  NormWeight style;
};

struct QkRopeArgs {          // in place on q [N, H, D] and k [N, Hkv, D] (last dim dense)
  void* q;
  void* k;
  int64_t q_stride_tok, q_stride_head, k_stride_tok, k_stride_head;
  const void* cos;           // [N, D] rows, token stride cos_sin_stride (sin the same)
  const void* sin;
  int64_t cos_sin_stride;
  const void* q_weight;      // [D] each; both nullptr: rotary embedding only
  const void* k_weight;
  int num_tokens, num_heads, num_kv_heads, head_dim;
  float eps;
  NormWeight style;
  // the paged cache write (v == nullptr: none): k after the rotary embedding and v as it is, into
  // cache [2, num_blocks, block_size, num_kv_heads, head_dim] (dense) at slots[token]; -1 is skipped
  const void* v;             // [N, Hkv, D], last dim dense
  int64_t v_stride_tok, v_stride_head;
  void* cache;
  int64_t cache_v_offset;    // elements from the K half to the V half
  const int64_t* slots;
  int cache_fp8;             // 1: a float8 e4m3 cache (16-bit models), stored fp8(k / k_scale), fp8(v / v_scale)
  float k_scale, v_scale;
};

int launch_rms_norm(int dtype, const RmsNormArgs& a, void* stream);
int launch_qk_norm_rope(int dtype, const QkRopeArgs& a, void* stream);
// act(gate) * up of [gate | up] rows, act by a GemvGate code (kGemvSilu or kGemvGeluTanh)
int launch_gate_and_mul(int dtype, int gate, void* out, const void* gate_up, int64_t stride, int rows, int inter,
                        void* stream);

// ---- temperature and greedy sampling (sampling.cu) -------------------------------------------------------
constexpr int kMaxSampleVocab = 1 << 20;

struct SampleArgs {          // element strides
  const void* logits;        // [rows, vocab] of logits_dtype, row stride row_stride (0 allowed), last dim dense
  int logits_dtype;          // kFloat32, kFloat16 or kBFloat16
  int64_t row_stride;
  const float* temperature;  // [rows] at stride t_stride, > 0
  int64_t t_stride;
  const float* uniforms;     // [rows] in [0, 1) at stride u_stride
  int64_t u_stride;
  int64_t* out;              // [rows] sampled token ids
  int rows, vocab;
};

int launch_sample_temperature(const SampleArgs& a, void* stream);

struct GreedyArgs {          // element strides
  const void* logits;        // [rows, vocab] of logits_dtype, row stride row_stride (0 allowed), last dim dense
  int logits_dtype;          // kFloat32, kFloat16 or kBFloat16
  int64_t row_stride;
  int64_t* out;              // [rows] the first index of each row's max, -1 for a NaN/+inf logit or all -inf
  int rows, vocab;
};

int launch_sample_greedy(const GreedyArgs& a, void* stream);

struct MaskArgs {            // element strides
  void* logits;              // [rows, vocab] of logits_dtype, changed in place: -inf where the bit is 0
  int logits_dtype;          // kFloat32, kFloat16 or kBFloat16
  int64_t row_stride;
  const void* bitmask;       // [rows, >= ceil(vocab / 32)] int32, row stride mask_stride; bit t % 32 of word t / 32
  int64_t mask_stride;
  int rows, vocab;
};

int launch_mask_logits(const MaskArgs& a, void* stream);

// ---- small-batch linear (gemv.cu) -----------------------------------------------------------------------
constexpr int kGemvMaxRows = 2;
// An RMSNorm input's rows stay in the CTA's shared memory: at most kGemvMaxRows x this many 16-bit elements.
constexpr int kGemvMaxNormWidth = 8192;

// How the GEMV forms its input rows from x.
enum GemvInput : int {
  kGemvPlain = 0,    // x
  kGemvRmsNorm = 1,  // RMSNorm(x + residual) as fused_ops.cu's RMSNorm; x + residual also to residual_out
};

// Which activation of a gated MLP the GEMV applies to its own [gate | up] outputs.
enum GemvGate : int {
  kGemvUngated = 0,   // out = x . weight^T
  kGemvSilu = 1,      // out[M, N/2] = SiLU(gate) * up
  kGemvGeluTanh = 2,  // out[M, N/2] = GELU-tanh(gate) * up (Gemma)
};

struct GemvArgs {            // out[M, N] = x[M, K] . weight[N, K]^T (+ bias[N]); element strides
  void* out;                 // row stride out_stride, last dim dense
  const void* x;             // row stride x_stride, last dim dense
  const void* weight;        // [N, K], dense
  const void* bias;          // nullptr: none
  int64_t x_stride, out_stride;
  int M, N, K;               // M <= kGemvMaxRows; K a multiple of 8; x, weight 16-byte aligned
  int input;                 // GemvInput
  int gate;                  // GemvGate; gated: weight rows are [gate (N/2) | up (N/2)], out is [M, N/2]
  // kGemvRmsNorm only (16-byte aligned rows, K <= kGemvMaxNormWidth):
  const void* residual;      // nullptr: no residual add
  void* residual_out;        // [M, K] dense: x + residual (with a residual)
  const void* norm_weight;   // [K]
  int64_t residual_stride;
  float eps;
  NormWeight norm_style;
};

int launch_gemv(int dtype, const GemvArgs& a, void* stream);

// ---- fused mixture-of-experts MLP (moe.cu) ----------------------------------------------------------------
// out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k]; bf16 / fp16.
constexpr int kMoeMaxExperts = 1024;  // the routing kernel keeps one counter per expert in a 1024-thread CTA

struct FusedMoeArgs {
  void* out;                 // [T, H], dense
  const void* hidden;        // [T, H], row stride hidden_stride (elements), last dim dense
  int64_t hidden_stride;
  const void* w13;           // [E, 2 * I, H], dense: gate rows then up rows
  const void* w2;            // [E, H, I], dense
  const int64_t* topk_ids;   // [T, topk], dense, each in [0, E) (others are skipped)
  const void* topk_weights;  // [T, topk], dense, float32 or the model's dtype (weights_dtype)
  int weights_dtype;
  void* workspace;           // moe_workspace_bytes(...) bytes, 256-byte aligned
  int T, H, I, E, topk;      // H and I multiples of 8; pointers 16-byte aligned
};

// The router's top-k (HF's routing: softmax in float32 over all E, the top k, optionally divided by their sum),
// from router logits [T, E] of the model's 16-bit type; one warp per token, topk <= 32.
constexpr int kMoeMaxTopK = 32;

struct MoeSelectArgs {
  const void* logits;        // [T, E], row stride row_stride (elements), last dim dense
  int64_t row_stride;
  void* weights;             // [T, topk], dense: the logits' dtype when round_weights, else float32
  int64_t* ids;              // [T, topk], dense, in descending weight (ties: lower id first)
  int T, E, topk;
  bool renormalize, round_weights;
};

int launch_moe_select_experts(int dtype, const MoeSelectArgs& a, void* stream);
int64_t moe_workspace_bytes(int T, int H, int I, int E, int topk);
int launch_fused_moe(int dtype, const FusedMoeArgs& a, void* stream);

}  // namespace pagednb
