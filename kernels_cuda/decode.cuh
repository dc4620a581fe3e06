// Paged attention on CUDA cores, one query row per CTA: decode rows (bf16/fp16/fp32) and every row in
// float32 (the test path). One CTA per (query row, kv head [x head group], split-K partition).
//
// GQA: a CTA holds the GMAX query heads of one kv head in registers and reads each K/V row once.
// Layout: a K (or V) row of one token is D contiguous elements; a warp's lanes are split into
// "slots" of TPR lanes, each slot reading one token row with 16-byte loads (TPR * 16 B = the row).
// Every slot runs its own online softmax over the tokens it visits (U tokens per step, loads issued
// together), so the main loop needs no shared memory and no barrier; slots are merged at the end
// (shuffles inside a warp, shared memory across warps). Scores are kept in log2 units (q is
// pre-scaled by scale * log2 e) and exponentiated with ex2.approx.
// With P > 1 partitions (the SPLIT instantiations), each CTA that has keys writes an unnormalised partial
// (o, m, l) and counts itself done; the last of a (row, kv head [x head group]) merges the partials into
// the output, so a split step is one launch (merge_partitions). Partitions past a row's keys (a short
// sequence, a sliding window) exit at once and are not merged. The host picks SPLIT per launch (P > 1), so
// a one-partition launch (every large batch) runs a kernel with no counter and no merge code: its
// registers and spills are those of a kernel that never splits (a merge in the same kernel raised them and
// cost batch 256 ~10%).
// PIPE (16-bit types; the default): each thread streams its own K/V vectors through a private
// shared-memory ring of S steps with cp.async, S - 1 steps ahead of the math, so loads stay in flight
// while it computes; no barrier is needed since a thread only reads what it copied itself. Without
// PIPE (float32, and variant 0) the loads of a step go straight to registers.
// An fp8 cache (KV = Fp8E4M3, 16-bit queries): the same kernel with 16 fp8 values per 16-byte load, so a
// lane covers 16 elements of a row (twice a 16-bit cache's) and a warp twice the tokens per step; K/V are
// converted to float as they are used, k_scale is folded into q's pre-scale and v_scale into the output.
// Launch order (the tensor-core decode kernel's too, its head columns the kv heads): the grid is (head columns,
// rows, partitions), so a row's CTAs are consecutive, and p.row_order
// (when set) lists the rows longest first. A launch of many rows of mixed lengths (the standard workload: 100
// to 2,000 keys) then ends on its shortest CTAs instead of a long row started last running alone, and a row's
// CTAs run together (its block table and token rows read by all of them at once). The row rank is blockIdx.y
// (rows past gridDim.y's limit continue along x); with the row and column decoded from one flat index instead,
// ptxas gave the kernels up to 31 more registers; this way they have main's (ptxas -v).
#pragma once

#include <type_traits>

#include "common.cuh"
#include "launchers.h"
#include "qk_rope.cuh"

namespace pagednb {

constexpr float kNegBig = -1e30f;  // finite "minus infinity" for running maxima: no inf - inf

// What a decode CTA attends to: the sequence of query row `row` and the keys [t_begin, t_end) of its
// split-K partition (blockIdx.z), causal and inside the sliding window. False: nothing to do here (a
// padding row past the last sequence, or a prefill row while only decode rows are served).
// BALANCED (the SPLIT kernels): the row's keys in partitions of equal size (to a token), as many as
// part_size-token partitions would take (at most P), so a row's CTAs finish together: a 1,100-key row under
// 1,024-token partitions runs as 550 + 550 rather than 1,024 + 76. Every one of the `parts` holds keys.
struct RowKeys {
  int seq, t_begin, t_end;
  int t_new;  // the sequence's first key written in this step (its new tokens' keys: t_new .. seq_len - 1)
  int parts;  // the row's partitions that hold keys, the first `parts` (1: the CTA writes the output itself)
};

// The sequence of query row `row`. In a decode step row r is sequence r (one new token each), which two
// independent loads confirm; otherwise (prefill chunks, verify rows) a binary search over qsl: a chain of
// ~log2(num_seqs) dependent loads, ~1 us at the start of every CTA of a 256-row step.
__device__ __forceinline__ int row_seq(const int* __restrict__ qsl, int num_seqs, int row) {
  if (row < num_seqs && __ldg(qsl + row) == row && __ldg(qsl + row + 1) == row + 1) return row;
  return find_seq(qsl, num_seqs, row);
}

template <bool BALANCED = false>
__device__ __forceinline__ bool row_keys(const AttnParams& p, int row, RowKeys& k) {
  k.seq = row_seq(p.qsl, p.num_seqs, row);
  if (k.seq < 0) return false;
  const int qs = __ldg(p.qsl + k.seq);
  const int qlen = __ldg(p.qsl + k.seq + 1) - qs;
  if (p.decode_only && qlen != 1) return false;
  k.t_new = __ldg(p.seq_lens + k.seq) - qlen;
  const int pos = k.t_new + (row - qs);
  const int lo = p.window > 0 ? max(0, pos - p.window + 1) : 0;
  if constexpr (BALANCED) {
    const int len = pos + 1 - lo;
    const int parts = min(p.P, (len + p.part_size - 1) / p.part_size);
    const int size = (len + parts - 1) / parts;
    k.parts = (len + size - 1) / size;  // parts, or fewer where the last would be empty
    k.t_begin = lo + blockIdx.z * size;
    k.t_end = min(pos + 1, k.t_begin + size);
  } else {
    k.t_begin = lo + blockIdx.z * p.part_size;
    k.t_end = min(pos + 1, k.t_begin + p.part_size);
    k.parts = min(p.P, (pos + 1 - lo + p.part_size - 1) / p.part_size);
  }
  return true;
}

// Split-K hand-off, after the CTA wrote its partial: true in the CTA that finished last among the row's
// `parts` partitions of this (kv head [x head group]). As a grid-wide barrier does it: the CTA's barrier
// orders every thread's partial writes before thread 0's release fence, which makes them visible device-wide
// before it counts the CTA in p.part_count; the last one fences again (acquire: the others' partials, counted
// before, are read after it) and resets the counter, so every launch leaves the array zero (allocated zeroed
// once: CUDA graph replays need nothing else). fence.acq_rel is what a release / acquire pattern needs
// (PTX ISA, memory consistency model); __threadfence() would be the heavier sequentially consistent fence.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }

// The counter of a (row, head column) is its CTAs' (blockIdx.x, blockIdx.y), the same in each partition
// (blockIdx.z): head column x row rank in both decode kernels' (head columns, rows) grid (a kv head is a column
// of the tensor-core kernel's; past kMaxGridRows rows, whole blocks of them: the backend's array is that large).
__device__ __forceinline__ bool last_partition(const AttnParams& p, int parts) {
  __shared__ bool s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    int* count = p.part_count + (int64_t)blockIdx.x * gridDim.y + blockIdx.y;
    fence_acq_rel_gpu();
    s_last = atomicAdd(count, 1) == parts - 1;
    if (s_last) {
      fence_acq_rel_gpu();
      *count = 0;  // no other CTA of this launch reads it again; the next launch comes after this one
    }
  }
  __syncthreads();
  return s_last;
}

// E consecutive floats through L2 (ld.global.cg: other SMs wrote them)
template <int E>
struct Floats {
  float v[E];
};
template <int E>
__device__ __forceinline__ Floats<E> ldcg_floats(const float* a) {
  Floats<E> r;
  if constexpr (E == 4) {
    const float4 x = __ldcg(reinterpret_cast<const float4*>(a));
    r.v[0] = x.x; r.v[1] = x.y; r.v[2] = x.z; r.v[3] = x.w;
  } else if constexpr (E == 2) {
    const float2 x = __ldcg(reinterpret_cast<const float2*>(a));
    r.v[0] = x.x; r.v[1] = x.y;
  } else {
    r.v[0] = __ldcg(a);
  }
  return r;
}

// The last CTA's merge of the `parts` partials of heads h0 .. h0 + ng - 1 (ng <= ROWS) of `row` into the
// output, in partition order with the arithmetic a separate reduce kernel used (the empty partitions it
// also read added exact zeros). E consecutive elements of a head per thread, as many as let the CTA's
// heads take one pass (at most 4); the first J partials are loaded at once, so a merge of up to J waits
// on L2 once. That holds J * (E + 2) registers, so J is 4 with E = 4 and under LEAN (the soft-capped
// instantiations, whose loops hold the most: 8 would cost the fp8 ones a CTA per SM; ptxas -v), else 8.
template <typename T, int D, int ROWS, int NT, bool LEAN>
__device__ __forceinline__ void merge_partitions(const AttnParams& p, int ng, int h0, int row, int parts) {
  constexpr int E = ROWS * D >= 4 * NT ? 4 : ROWS * D >= 2 * NT ? 2 : 1;
  constexpr int J = LEAN || E == 4 ? 4 : 8;
  constexpr int VE = D / E;
  static_assert(D % E == 0, "head_dim");
  for (int idx = threadIdx.x; idx < ng * VE; idx += NT) {
    const int g = idx / VE, d = (idx % VE) * E;
    const int64_t base = ((int64_t)row * p.H + h0 + g) * p.P;
    const float2* ml = reinterpret_cast<const float2*>(p.part_ml) + base;
    const float* po = p.part_o + base * D + d;
    float2 mj[J];
    Floats<E> oj[J];
#pragma unroll
    for (int j = 0; j < J; ++j)
      if (j < parts) { mj[j] = __ldcg(ml + j); oj[j] = ldcg_floats<E>(po + j * D); }
    float M = kNegBig;
#pragma unroll
    for (int j = 0; j < J; ++j)
      if (j < parts) M = fmaxf(M, mj[j].x);
    for (int j = J; j < parts; ++j) M = fmaxf(M, __ldcg(ml + j).x);
    float L = 0.f, O[E];
#pragma unroll
    for (int e = 0; e < E; ++e) O[e] = 0.f;
    auto add = [&](float2 m, const Floats<E>& o) {
      const float f = fast_exp2(m.x - M);
      L += m.y * f;
#pragma unroll
      for (int e = 0; e < E; ++e) O[e] += o.v[e] * f;
    };
#pragma unroll
    for (int j = 0; j < J; ++j)
      if (j < parts) add(mj[j], oj[j]);
    for (int j = J; j < parts; ++j) add(__ldcg(ml + j), ldcg_floats<E>(po + j * D));
    T* out = reinterpret_cast<T*>(p.out) + ((int64_t)row * p.H + h0 + g) * D + d;
#pragma unroll
    for (int e = 0; e < E; ++e) out[e] = Elem<T>::from_float(O[e] / L * p.v_scale);
  }
}

// Merges the NW warps' partial results for the CTA's `ng` query heads h0.. of `row`, left in shared
// memory as o [NW][ROWS][D] and m, l [NW][ROWS] (unnormalised, maxima in log2 units): the normalised
// output without SPLIT or when the row has one partition with keys, else partition blockIdx.z's partial
// (o, m, l), merged by the last partition to finish (LEAN: see merge_partitions).
template <typename T, int D, int NW, int ROWS, int NT, bool SPLIT, bool LEAN>
__device__ __forceinline__ void merge_warps_and_store(const AttnParams& p, const float* s_o, const float* s_m,
                                                      const float* s_l, int ng, int h0, int row, int parts) {
  for (int idx = threadIdx.x; idx < ng * D; idx += NT) {
    const int g = idx / D, d = idx % D;
    float M = s_m[g];
#pragma unroll
    for (int w = 1; w < NW; ++w) M = fmaxf(M, s_m[w * ROWS + g]);
    float L = 0.f, O = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float f = fast_exp2(s_m[w * ROWS + g] - M);
      L += s_l[w * ROWS + g] * f;
      O += s_o[(w * ROWS + g) * D + d] * f;
    }
    const int h = h0 + g;
    // without SPLIT, P is 1; tested at run time all the same: with a constant ptxas allocates 9 of the 146 bf16
    // one-partition kernels differently (2 spill), this way all are as before SPLIT existed (ptxas -v)
    if (SPLIT ? parts == 1 : p.P == 1) {
      T* out = reinterpret_cast<T*>(p.out) + ((int64_t)row * p.H + h) * D;
      out[d] = Elem<T>::from_float(O / L * p.v_scale);
    } else {
      const int64_t pi = ((int64_t)row * p.H + h) * p.P + blockIdx.z;
      p.part_o[pi * D + d] = O;
      if (d == 0) { p.part_ml[2 * pi] = M; p.part_ml[2 * pi + 1] = L; }
    }
  }
  if constexpr (SPLIT)
    if (parts > 1 && last_partition(p, parts)) merge_partitions<T, D, ROWS, NT, LEAN>(p, ng, h0, row, parts);
}

template <typename KV, int D, int GMAX>  // KV: the cache's element type
struct RowCfg {
  static constexpr int VEC = Elem<KV>::kVec;                      // elements per 16 B
  static constexpr int TPR = (D / VEC) < 32 ? (D / VEC) : 32;     // lanes per token row
  static constexpr int NV = D / (VEC * TPR);                      // 16 B vectors per lane per row
  static constexpr int TPW = 32 / TPR;                            // token slots per warp
  static constexpr int NW = 4;
  static constexpr int NT = 32 * NW;
  static constexpr int SLOTS = NW * TPW;
  static constexpr int U = GMAX >= 8 ? 2 : 4;                     // tokens per slot per step
  static constexpr int STEP = SLOTS * U;
  static constexpr int S = 3;                                     // ring stages (PIPE)
  static constexpr int RING_BYTES = S * U * NV * 2 * NT * 16;
  static constexpr int MERGE_BYTES = NW * GMAX * (D + 2) * 4;
  static_assert(D % (VEC * TPR) == 0, "head_dim");
  static constexpr int smem(bool pipe) { return pipe && RING_BYTES > MERGE_BYTES ? RING_BYTES : MERGE_BYTES; }
};

// VEC elements of T from global memory into floats (one or two 16-byte loads: an fp8 cache's 16 per lane)
template <typename T, int VEC>
__device__ __forceinline__ void ldg_floats(const T* src, float* f) {
#pragma unroll
  for (int i = 0; i < VEC / Elem<T>::kVec; ++i) Elem<T>::unpack(ldg16(src + i * Elem<T>::kVec), f + i * Elem<T>::kVec);
}

constexpr int kPrefetchBytes = 64 << 10;  // K/V bytes a SPLIT CTA prefetches into L2 before its wait (see below)

// Before griddepcontrol.wait a decode CTA finds its row and starts copying its keys, while the kernel before
// it (q/k norm + RoPE + cache write) runs. Allowed by common.cuh's rule 1: the metadata comes from host copies,
// the launch order (row_order) from a sort that ran before an earlier layer's launch (p.early_keys: the backend
// clears it for the launch right behind the sort, and where PAGEDNB_EARLY_KEYS=0), and the keys before the
// step's first new one (RowKeys::t_new) were written by earlier steps. The new tokens' keys, which the kernel
// before writes, are copied after the wait.
enum class Keys { All, Old, New };  // the keys an issue() call copies: all, those before t_new, the rest
template <Keys W>
using KeysOf = std::integral_constant<Keys, W>;
template <Keys W>
__device__ __forceinline__ bool takes(KeysOf<W>, int t, int t_new) {
  if constexpr (W == Keys::All) return true;
  else if constexpr (W == Keys::Old) return t < t_new;
  else return t >= t_new;
}
template <Keys W>
__device__ __forceinline__ void commit_unless_old(KeysOf<W>) {
  if constexpr (W != Keys::Old) cp_async_commit();
}

// A one-partition decode CTA's first line: the next kernel may launch; the wait comes later unless the row
// order cannot be read before it.
__device__ __forceinline__ void decode_entry(const AttnParams& p) {
  pdl_launch_dependents();
  if (!p.early_keys) pdl_wait();
}

struct NoHook {
  __device__ void operator()() const {}
};

// The ring's first S - 1 stages around the wait: every stage's old keys, the wait, then every stage's new keys,
// each stage committing its cp.async group there (the old keys' copies all join the first group, so a stage's
// copies have landed once its own group has). issue(i, which) copies stage i's keys of that kind; after_wait()
// runs between the wait and the new keys' copies (FusedRope writes the new token's K/V there).
// A SPLIT CTA has waited in split_entry: after_wait() first, then its stages are copied whole (with the fused
// prologue, copying the old keys before it measured slower at batch 1: 13.3 against 12.6 us per layer).
template <int S, bool SPLIT, typename Issue, typename AfterWait = NoHook>
__device__ __forceinline__ void ring_prologue(Issue&& issue, AfterWait&& after_wait = AfterWait{}) {
  if constexpr (SPLIT) {
    after_wait();
#pragma unroll
    for (int i = 0; i < S - 1; ++i) issue(i, KeysOf<Keys::All>{});
  } else {
#pragma unroll
    for (int i = 0; i < S - 1; ++i) issue(i, KeysOf<Keys::Old>{});
    pdl_wait();
    after_wait();
#pragma unroll
    for (int i = 0; i < S - 1; ++i) issue(i, KeysOf<Keys::New>{});
  }
}

// ---- the step's q/k norm + rotary embedding and K/V cache write in a decode CTA's prologue (p.fuse_rope) ----
// In a decode-only step the separate qk_norm_rope launch (fused_ops.cu) costs a launch and its drain per layer. With
// fuse_rope each decode CTA does that work for itself, after its wait: its query heads into a shared-memory tile
// (the kernel's q load reads them from there, not from global memory), and, in the CTA whose keys hold the row's
// new token, that token's K (normed, rotated, rounded to T, quantised for an fp8 cache) and V into their cache slot,
// before its ring copies the new keys (the CTA's barrier orders the stores before the copies). The math is
// qk_rope.cuh's, so the bits are the separate launch's. The CTA's 128 threads take the items (its query heads, then
// its kv heads' K, then their V) in groups of QkCfg's LANES lanes, one 16-byte vector per lane.
template <typename T, typename KV, int D>
struct FusedRope {
  using C = QkCfg<T, D>;
  static constexpr int LANES = C::LANES, E = C::E, ITEMS = C::ITEMS;
  static_assert(sizeof(T) == 2 && C::NV == 1, "16-bit rows: one 16-byte vector per lane");
  uint4 cos, sin, q_w, k_w;  // the lane's parts of the token's cos and sin rows and of the norm weights
  int64_t slot;

  // Before the wait (common.cuh's rule 1, as qk_norm_rope_kernel reads them): the norm weights (no kernel writes
  // them), the token's cache slot (a host copy) and its cos/sin rows (looked up by torch kernels at the start of
  // the forward, complete before the step's first PDL kernel started).
  __device__ __forceinline__ void load(const AttnParams& p, int row) {
    const int at = (threadIdx.x % LANES) * E;
    cos = ldg16(static_cast<const T*>(p.rope_cos) + (int64_t)row * p.cos_sin_stride + at);
    sin = ldg16(static_cast<const T*>(p.rope_sin) + (int64_t)row * p.cos_sin_stride + at);
    if (p.q_norm_weight != nullptr) {
      q_w = ldg16(static_cast<const T*>(p.q_norm_weight) + at);
      k_w = ldg16(static_cast<const T*>(p.k_norm_weight) + at);
    }
    slot = __ldg(p.slots + row);
  }

  // After the wait: the query heads of kv heads kvh0 .. kvh0 + KH - 1 into q_tile ([KH * G][D]) and, where
  // writes, those kv heads' K and V of the token into the cache. Every thread of the CTA calls it (shuffles and
  // the closing barrier).
  __device__ __forceinline__ void apply(const AttnParams& p, int row, int kvh0, int KH, bool writes,
                                        T* q_tile) const {
    const int lane = threadIdx.x % LANES;
    const int nq = KH * p.G, items = nq + (writes ? 2 * KH : 0);
    const bool norm = p.q_norm_weight != nullptr;
    const NormWeight style{p.norm_offset, p.norm_in_float32};
    float c[E], s[E];
    Elem<T>::unpack(cos, c);
    Elem<T>::unpack(sin, s);
    for (int base = 0; base < items; base += ITEMS) {  // the same passes in every thread
      const int item = base + threadIdx.x / LANES;
      const bool valid = item < items, is_q = item < nq, is_v = item >= nq + KH;
      const int kvh = kvh0 + (is_q ? 0 : item - nq - (is_v ? KH : 0));
      const T* src =
          is_q   ? static_cast<const T*>(p.q) + row * p.q_stride_tok + (int64_t)(kvh0 * p.G + item) * p.q_stride_head
          : is_v ? static_cast<const T*>(p.v_new) + row * p.v_stride_tok + (int64_t)kvh * p.v_stride_head
                 : static_cast<const T*>(p.k_new) + row * p.k_stride_tok + (int64_t)kvh * p.k_stride_head;
      float x[E], w[E];
      if (valid) Elem<T>::unpack(ldg16(src + lane * E), x);
      else
#pragma unroll
        for (int e = 0; e < E; ++e) x[e] = 0.f;
      if (norm) Elem<T>::unpack(is_q ? q_w : k_w, w);
      qk_norm_rope_lanes<T, LANES, E>(x, w, c, s, norm, valid && !is_v, lane, p.norm_eps, style);
      if (!valid) continue;
      if (is_q) {
        *reinterpret_cast<uint4*>(q_tile + item * D + lane * E) = pack16<T>(x);
        continue;
      }
      if (slot < 0) continue;
      const int64_t at = (is_v ? p.v_offset : 0) + (slot * p.Hkv + kvh) * D + lane * E;  // elements (fp8: bytes)
      if constexpr (std::is_same<KV, Fp8E4M3>::value) {
        if (!is_v)  // k as stored in the model's dtype, then quantised (the reference's order)
#pragma unroll
          for (int e = 0; e < E; ++e) x[e] = round_to<T>(x[e]);
        store_fp8_vec<T>(static_cast<uint8_t*>(const_cast<void*>(p.cache)) + at, x, is_v ? p.v_scale : p.k_scale);
      } else {
        *reinterpret_cast<uint4*>(static_cast<T*>(const_cast<void*>(p.cache)) + at) = pack16<T>(x);
      }
    }
    __syncthreads();
  }
};

// The SPLIT kernels' entry (both decode kernels). With P > 1 (small batches) a CTA's time is a chain of
// dependent loads (the row's sequence, its block table, then K/V from DRAM a few ring steps at a time), so
// they start before pdl_wait(), overlapping the kernel before: the row's keys are looked up and the CTA's
// first kPrefetchBytes of K/V (a whole 128-token partition at head_dim 128) are prefetched into L2, where
// the copies after the wait find them. Allowed before the wait (common.cuh's rule 1): the metadata comes
// from host copies and non-PDL torch kernels, all complete before the step's first PDL kernel starts (the
// decode kernels' row_order, sorted in the step's first layer, where p.early_keys says so: see Keys); a
// prefetch returns no value (L2 is the point of coherence), so the token the kernel before writes is read
// after the wait as ever. False: nothing to do in this CTA (no row, or a partition past its keys), returned
// after the wait as every CTA must.
template <typename KV, int D, int NT, int KVC = 1>  // KVC: the CTA's kv heads, kvh the first
__device__ __forceinline__ bool split_entry(const AttnParams& p, int row, int kvh, RowKeys& keys) {
  pdl_launch_dependents();
  const bool work = row_keys<true>(p, row, keys) && blockIdx.z < keys.parts;
  if (work) {
    constexpr int kHeadBytes = D * (int)sizeof(KV);          // one token's K (or V) of one kv head
    constexpr int kRowBytes = KVC * kHeadBytes;               // ... of the CTA's kv heads
    constexpr int kLines = kRowBytes > 128 ? kRowBytes / 128 : 1;
    const int tokens = min(keys.t_end - keys.t_begin, kPrefetchBytes / (2 * kRowBytes));
    const int* bt = p.block_tables + (int64_t)keys.seq * p.bt_stride;
    const char* kbase = static_cast<const char*>(p.cache) + (int64_t)kvh * kHeadBytes;
    const int64_t token_bytes = (int64_t)p.Hkv * kHeadBytes, v_bytes = p.v_offset * (int64_t)sizeof(KV);
    const int bs_mask = (1 << p.bs_log2) - 1;
    for (int i = threadIdx.x; i < tokens * kLines; i += NT) {
      const int t = keys.t_begin + i / kLines;
      const int blk = __ldg(bt + (t >> p.bs_log2));
      const char* k = kbase + (((int64_t)blk << p.bs_log2) + (t & bs_mask)) * token_bytes + (i % kLines) * 128;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(k));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(k + v_bytes));
    }
  }
  pdl_wait();
  return work;
}

// gridDim.y's limit: a row-kernel launch of more rows (a prefill-sized float32 or mixed step) continues in
// further blocks of `cols` head columns along x.
constexpr int kMaxGridRows = 65535;

// The query row of a decode CTA (see "Launch order" at the top); its head column is blockIdx.x % cols.
__device__ __forceinline__ int cta_row(const AttnParams& p, int cols) {
  const int rank = blockIdx.y + (blockIdx.x / cols) * kMaxGridRows;
  return p.row_order ? (int)p.row_order[rank] : rank;
}

// The decode kernels' grid (head columns, rows, partitions) for `cols` head columns, the layout cta_row decodes;
// false where a sorted launch would need more than one block of rows (the order covers one).
inline bool decode_grid(const AttnParams& p, int cols, dim3& grid) {
  const int blocks = (p.num_rows + kMaxGridRows - 1) / kMaxGridRows;
  if (p.row_order && blocks > 1) return false;
  grid = dim3(cols * blocks, blocks > 1 ? kMaxGridRows : p.num_rows, p.P);
  return true;
}

// T: the query's type; KV: the cache's (T, or Fp8E4M3). CAP: Gemma 2's soft-capping. SPLIT: P > 1.
// KVC: kv heads per CTA (row_kv_per_cta): with 2, a CTA serves two adjacent kv heads with all of their query
// heads (G == GMAX), whose token rows are one row of 2 * D elements: a slot's lanes split into one group per kv
// head, each with its own queries, dot-product reduction and softmax; the pair's heads are contiguous in q and
// the output, so the merge takes them as 2 * GMAX rows.
template <typename T, typename KV, int D, int GMAX, bool PIPE, bool CAP = false, bool SPLIT = false, int KVC = 1>
__global__ void __launch_bounds__(128) row_attn_kernel(const AttnParams p) {
  if constexpr (!SPLIT) decode_entry(p);
  using C = RowCfg<KV, D * KVC, GMAX>;
  constexpr int VEC = C::VEC, TPR = C::TPR, NV = C::NV, TPW = C::TPW, NW = C::NW, U = C::U, S = C::S;
  constexpr int NT = C::NT;
  constexpr int TPRH = TPR / KVC;  // lanes per kv head of a token row
  constexpr int ROWS = GMAX * KVC;  // query heads per CTA
  static_assert(KVC == 1 || (NV == 1 && TPRH * VEC == D), "paired kv heads: one vector per lane, a lane in one head");
  static_assert(NW * ROWS * (D + 2) * 4 <= C::smem(PIPE), "the warps' merge fits the CTA's shared memory");
  extern __shared__ __align__(16) unsigned char dyn_smem[];

  const int cols = p.Hkv / KVC * p.head_groups;
  if constexpr (SPLIT)  // the order is written by the step's sort: before the wait only where early_keys says so
    if (p.row_order && !p.early_keys) pdl_wait();
  const int row = cta_row(p, cols);
  RowKeys keys;
  if constexpr (SPLIT) {
    if (!split_entry<KV, D, NT, KVC>(p, row, (blockIdx.x % cols) / p.head_groups * KVC, keys)) return;
  } else if (!row_keys(p, row, keys)) {
    pdl_wait();  // common.cuh's rule 2
    return;
  }
  const int s = keys.seq, t_begin = keys.t_begin, t_end = keys.t_end, t_new = keys.t_new;

  const int kvh = (blockIdx.x % cols) / p.head_groups * KVC;  // the CTA's (first) kv head
  const int g0 = (blockIdx.x % p.head_groups) * GMAX;  // cols is a multiple of head_groups
  const int ng = min(GMAX, p.G - g0);
  const int h0 = kvh * p.G + g0;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane % TPR;
  const int slot = warp * TPW + lane / TPR;
  const int half = sub / TPRH;  // the lane's kv head in the CTA (0 unless KVC == 2)

  float m[GMAX], l[GMAX], acc[GMAX][NV][VEC];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = kNegBig; l[g] = 0.f;
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[g][v][e] = 0.f;
  }

  const int* bt = p.block_tables + (int64_t)s * p.bt_stride;
  const int64_t row_elems = (int64_t)p.Hkv * D;
  const KV* kbase = reinterpret_cast<const KV*>(p.cache) + (int64_t)kvh * D + sub * VEC;
  const int bs_mask = (1 << p.bs_log2) - 1;

  const int nsteps = t_end > t_begin ? (t_end - t_begin + C::STEP - 1) / C::STEP : 0;
  uint4* ring = reinterpret_cast<uint4*>(dyn_smem);  // [S][U][NV][2][NT], 16 B per thread and vector
  // cp.async of step i's keys of one kind (Keys) into stage i % S (an empty group past the end)
  auto issue = [&](int i, auto which) {
    if (i < nsteps) {
      const int t0 = t_begin + i * C::STEP;
      uint4* st = ring + (i % S) * (U * NV * 2 * NT) + threadIdx.x;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int t = t0 + u * C::SLOTS + slot;
        const int tc = t < t_end ? t : t_end - 1;
        if (takes(which, tc, t_new)) {
          const int blk = __ldg(bt + (tc >> p.bs_log2));
          const KV* kp = kbase + (((int64_t)blk << p.bs_log2) + (tc & bs_mask)) * row_elems;
#pragma unroll
          for (int v = 0; v < NV; ++v) {
            cp_async16(st + ((u * NV + v) * 2) * NT, kp + v * TPR * VEC, true);
            cp_async16(st + ((u * NV + v) * 2 + 1) * NT, kp + p.v_offset + v * TPR * VEC, true);
          }
        }
      }
    }
    commit_unless_old(which);
  };
  if constexpr (PIPE) ring_prologue<S, SPLIT>(issue);
  else pdl_wait();

  // query heads of this CTA in registers, pre-scaled into log2 units (an fp8 cache's k_scale folded in)
  float qf[GMAX][NV][VEC];
  const T* qrow = reinterpret_cast<const T*>(p.q) + (int64_t)row * p.q_stride_tok;
  const float q_scale = p.scale_log2 * p.k_scale;
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      if (g < ng) {
        ldg_floats<T, VEC>(qrow + (int64_t)(h0 + half * p.G + g) * p.q_stride_head + (v * TPR + sub) * VEC - half * D,
                           qf[g][v]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) qf[g][v][e] *= q_scale;
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) qf[g][v][e] = 0.f;
      }
    }
  }

  for (int i = 0; i < nsteps; ++i) {
    const int t0 = t_begin + i * C::STEP;
    uint4 kr[U][NV], vr[U][NV];
    bool valid[U];
    if constexpr (PIPE) {
      issue(i + S - 1, KeysOf<Keys::All>{});
      cp_async_wait<S - 1>();
      const uint4* st = ring + (i % S) * (U * NV * 2 * NT) + threadIdx.x;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        valid[u] = t0 + u * C::SLOTS + slot < t_end;
#pragma unroll
        for (int v = 0; v < NV; ++v) {
          kr[u][v] = st[((u * NV + v) * 2) * NT];
          vr[u][v] = st[((u * NV + v) * 2 + 1) * NT];
        }
      }
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int t = t0 + u * C::SLOTS + slot;
        valid[u] = t < t_end;
        const int tc = valid[u] ? t : t_end - 1;  // a real token of this partition: never garbage
        const int blk = __ldg(bt + (tc >> p.bs_log2));
        const KV* kp = kbase + (((int64_t)blk << p.bs_log2) + (tc & bs_mask)) * row_elems;
#pragma unroll
        for (int v = 0; v < NV; ++v) {
          kr[u][v] = ldg16(kp + v * TPR * VEC);
          vr[u][v] = ldg16(kp + p.v_offset + v * TPR * VEC);
        }
      }
    }
    float sc[U][GMAX];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[NV][VEC];
#pragma unroll
      for (int v = 0; v < NV; ++v) Elem<KV>::unpack(kr[u][v], kf[v]);
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        float d = 0.f;
#pragma unroll
        for (int v = 0; v < NV; ++v)
#pragma unroll
          for (int e = 0; e < VEC; ++e) d = fmaf(qf[g][v][e], kf[v][e], d);
#pragma unroll
        for (int o = TPRH / 2; o >= 1; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        sc[u][g] = valid[u] ? d : -INFINITY;  // q carries scale * log2(e)
      }
    }
    if constexpr (CAP) {  // its own instantiation: no other model evaluates tanh per score or pays registers
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int g = 0; g < GMAX; ++g)
          if (valid[u]) sc[u][g] = soft_cap(sc[u][g], p.softcap_log2);
    }
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = fmaxf(mx, sc[u][g]);
      const float alpha = fast_exp2(m[g] - mx);
      m[g] = mx;
      float lsum = l[g] * alpha;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        sc[u][g] = fast_exp2(sc[u][g] - mx);
        lsum += sc[u][g];
      }
      l[g] = lsum;
#pragma unroll
      for (int v = 0; v < NV; ++v)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][v][e] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        float vf[VEC];
        Elem<KV>::unpack(vr[u][v], vf);
#pragma unroll
        for (int g = 0; g < GMAX; ++g)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g][v][e] = fmaf(sc[u][g], vf[e], acc[g][v][e]);
      }
    }
  }

  // merge the slots of a warp (lanes that differ in the bits above TPR)
#pragma unroll
  for (int off = TPR; off < 32; off <<= 1) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float lo_ = __shfl_xor_sync(0xffffffffu, l[g], off);
      const float mn = fmaxf(m[g], mo);
      const float a = fast_exp2(m[g] - mn), b = fast_exp2(mo - mn);
      l[g] = l[g] * a + lo_ * b;
      m[g] = mn;
#pragma unroll
      for (int v = 0; v < NV; ++v)
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float ao = __shfl_xor_sync(0xffffffffu, acc[g][v][e], off);
          acc[g][v][e] = acc[g][v][e] * a + ao * b;
        }
    }
  }

  // merge the warps through shared memory (the ring's space once every copy has landed)
  if constexpr (PIPE) {
    cp_async_wait<0>();
    __syncthreads();
  }
  auto s_acc = reinterpret_cast<float (*)[ROWS][D]>(dyn_smem);
  auto s_m = reinterpret_cast<float (*)[ROWS]>(dyn_smem + NW * ROWS * D * 4);
  auto s_l = reinterpret_cast<float (*)[ROWS]>(dyn_smem + NW * ROWS * (D + 1) * 4);
  if (lane < TPR) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
#pragma unroll
      for (int v = 0; v < NV; ++v)
#pragma unroll
        for (int e = 0; e < VEC; ++e) s_acc[warp][half * GMAX + g][(v * TPR + sub) * VEC + e - half * D] = acc[g][v][e];
      if (sub % TPRH == 0) { s_m[warp][half * GMAX + g] = m[g]; s_l[warp][half * GMAX + g] = l[g]; }
    }
  }
  __syncthreads();
  merge_warps_and_store<T, D, NW, ROWS, NT, SPLIT, CAP>(p, &s_acc[0][0][0], &s_m[0][0], &s_l[0][0], ng * KVC, h0, row,
                                                        keys.parts);
}

// The pipelined variant for 16-bit types unless variant 0 is asked for; float32 never (its ring would
// not fit beside a useful number of CTAs, and it exists for tests).
template <typename T>
constexpr bool pipe_ok() { return sizeof(T) == 2; }

template <typename T, typename KV, int D, int GMAX, bool PIPE, bool CAP, bool SPLIT, int KVC>
int launch_row_variant(const AttnParams& p, cudaStream_t st) {
  using C = RowCfg<KV, D * KVC, GMAX>;
  constexpr int smem = C::smem(PIPE);
  static bool configured = false;
  if (!configured) {
    cudaError_t e = cudaFuncSetAttribute(row_attn_kernel<T, KV, D, GMAX, PIPE, CAP, SPLIT, KVC>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return (int)e;
    configured = true;
  }
  dim3 grid;
  if (!decode_grid(p, p.Hkv / KVC * p.head_groups, grid)) return -1;
  return launch_pdl(row_attn_kernel<T, KV, D, GMAX, PIPE, CAP, SPLIT, KVC>, grid, dim3(C::NT), smem, st, p);
}

template <typename T, typename KV, int D, int GMAX, bool PIPE, bool CAP, int KVC>
int launch_row_split(const AttnParams& p, cudaStream_t st) {
  return p.P > 1 ? launch_row_variant<T, KV, D, GMAX, PIPE, CAP, true, KVC>(p, st)
                 : launch_row_variant<T, KV, D, GMAX, PIPE, CAP, false, KVC>(p, st);
}

template <typename T, typename KV, int D, int GMAX, bool PIPE, int KVC = 1>
int launch_row_kernel(const AttnParams& p, cudaStream_t st) {
  return p.softcap_log2 > 0.f ? launch_row_split<T, KV, D, GMAX, PIPE, true, KVC>(p, st)
                              : launch_row_split<T, KV, D, GMAX, PIPE, false, KVC>(p, st);
}

template <typename T, typename KV, int D, int GMAX>
int launch_row_kv(const AttnParams& p, cudaStream_t st) {
  if constexpr (pipe_ok<T>()) {
    if (p.row_variant == 0) return launch_row_kernel<T, KV, D, GMAX, false>(p, st);
    if constexpr (std::is_same<KV, Fp8E4M3>::value && D == 128 && GMAX <= 2)  // row_kv_per_cta's only 2
      if (row_kv_per_cta(p.G, D, p.Hkv, p.cache_fp8, p.row_variant) == 2)
        return launch_row_kernel<T, KV, D, GMAX, true, 2>(p, st);
    return launch_row_kernel<T, KV, D, GMAX, true>(p, st);
  } else {
    return launch_row_kernel<T, KV, D, GMAX, false>(p, st);
  }
}

template <typename T, int D, int GMAX>
int launch_row_t(const AttnParams& p, cudaStream_t st) {
  if constexpr (pipe_ok<T>()) {
    if constexpr (GMAX <= 4)  // an fp8 cache's CTAs take at most 4 heads (row_gmax)
      return p.cache_fp8 ? launch_row_kv<T, Fp8E4M3, D, GMAX>(p, st) : launch_row_kv<T, T, D, GMAX>(p, st);
    else
      return p.cache_fp8 ? -1 : launch_row_kv<T, T, D, GMAX>(p, st);
  } else {
    return launch_row_kv<T, T, D, GMAX>(p, st);  // float32 models keep a float32 cache
  }
}

template <typename T, typename KV, int D, int GMAX>
int occupancy_kv(int variant) {
  int n = 0;
  cudaError_t e;
  if (pipe_ok<T>() && variant != 0)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, row_attn_kernel<T, KV, D, GMAX, pipe_ok<T>()>, 128,
                                                      RowCfg<KV, D, GMAX>::smem(pipe_ok<T>()));
  else
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, row_attn_kernel<T, KV, D, GMAX, false>, 128,
                                                      RowCfg<KV, D, GMAX>::smem(false));
  return e == cudaSuccess && n > 0 ? n : 1;
}

template <typename T, int D, int GMAX>
int occupancy_t(int variant, int cache_fp8) {
  if constexpr (pipe_ok<T>() && GMAX <= 4)
    if (cache_fp8) return occupancy_kv<T, Fp8E4M3, D, GMAX>(variant);
  return occupancy_kv<T, T, D, GMAX>(variant);
}

}  // namespace pagednb

#include "decode_group_mma.cuh"  // the tensor-core kernel for large groups (uses kNegBig, merge_warps_and_store)

namespace pagednb {

// One head_dim's decode launches for query type T: the tensor-core kernels where group_mma_applies, else the row
// kernel at the GMAX the group needs. Each decode_hd<D>.cu instantiates them (PAGEDNB_DECODE_INSTANCES) for every
// dtype at its head_dim, so the five build units compile in parallel (one unit per dtype over every head_dim took
// ~2 min on one core, the whole JIT build's critical path); decode.cu dispatches to them at run time.
template <typename T, int D>
int launch_decode_hd(const AttnParams& p, cudaStream_t st) {
  if constexpr (sizeof(T) == 2) {
    const int code = std::is_same<T, __half>::value ? kFloat16 : kBFloat16;
    if (group_mma_applies(code, D, p.G, p.row_variant, p.cache_fp8)) return launch_group_mma_hd<T, D>(p, st);
  }
  if (p.fuse_rope) return -1;  // decode_fuses_rope: the tensor-core fp8 kernel only
  switch (row_gmax(p.G, p.cache_fp8)) {
    case 1: return launch_row_t<T, D, 1>(p, st);
    case 2: return launch_row_t<T, D, 2>(p, st);
    case 4: return launch_row_t<T, D, 4>(p, st);
    default: return launch_row_t<T, D, 8>(p, st);
  }
}
template <typename T, int D>
int occupancy_row_hd(int gmax, int variant, int cache_fp8) {
  switch (gmax) {
    case 1: return occupancy_t<T, D, 1>(variant, cache_fp8);
    case 2: return occupancy_t<T, D, 2>(variant, cache_fp8);
    case 4: return occupancy_t<T, D, 4>(variant, cache_fp8);
    default: return occupancy_t<T, D, 8>(variant, cache_fp8);
  }
}

// Explicit instantiations (PREFIX empty) in decode_hd<D>.cu, or declarations of them (PREFIX extern) in decode.cu,
// which keep the dispatching unit from compiling any kernel itself.
#define PAGEDNB_DECODE_INSTANCES_T(PREFIX, T, D)                                   \
  PREFIX template int launch_decode_hd<T, D>(const AttnParams&, cudaStream_t);    \
  PREFIX template int occupancy_row_hd<T, D>(int, int, int);
#define PAGEDNB_DECODE_INSTANCES_16(PREFIX, T, D) \
  PAGEDNB_DECODE_INSTANCES_T(PREFIX, T, D)        \
  PREFIX template int occupancy_group_mma_hd<T, D>(int);
#define PAGEDNB_DECODE_INSTANCES(PREFIX, D)                 \
  PAGEDNB_DECODE_INSTANCES_T(PREFIX, float, D)              \
  PAGEDNB_DECODE_INSTANCES_16(PREFIX, __half, D)            \
  PAGEDNB_DECODE_INSTANCES_16(PREFIX, __nv_bfloat16, D)

}  // namespace pagednb
