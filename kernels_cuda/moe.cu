// The fused mixture-of-experts MLP: out[t] = sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)).
//
// The router's choice is one launch of its own (launch_moe_select_experts): one warp per token takes the top k
// of its router logits (the softmax is monotone, so it picks on the logits; ties go to the lower expert id),
// the softmax of the chosen ones over the whole row, their renormalisation and rounding, as HF routes.
//
// Four launches, no host synchronisation and only shape-dependent grids, so a CUDA graph can capture them:
//   1. route: one 1024-thread CTA counts the (token, slot) pairs per expert, scans the counts into each
//      expert's first row (expert_offsets) and first M-tile (tile_offsets), and lists the pairs in expert
//      order (sorted_pairs). Within an expert the order is whatever the atomics give; every row is computed
//      on its own, so results do not depend on it.
//   2. gate/up GEMM: a grouped GEMM over the experts' M-tiles on tensor cores (mma.sync m16n8k16, fp32
//      accumulate, cp.async multi-stage pipeline, ldmatrix from padded shared memory). The A rows are
//      gathered from the tokens' hidden states; each CTA loads gate rows j.. and the matching up rows I + j..
//      so one thread holds gate and up of the same element and writes silu(gate) * up (act, in expert order).
//   3. down GEMM: the same kernel over act, each row written to its pair's slot (ybuf, in token order).
//   4. combine: out[t] = sum_k w[t, k] * ybuf[t * topk + k] in float32, rounded once.
// The grid covers the most M-tiles any routing can need (ceil(P / BM) + min(E, P) for P pairs); CTAs past
// the tiles this routing needs return at once.
//
// Up to 16 tokens (a decode step of a small batch) two launches do it all ("direct" tiles): with one 16-row
// tile per expert at most, each CTA finds its expert and rows from the ids itself (tile b: the b-th smallest
// expert routed to), and the down CTA that finishes a column block last adds up the top k there. A 1-token
// layer reads ~75 MB of weights in ~18 us at the copy bandwidth; the routing kernel and the combine were two
// dependent launches of a few microseconds each on that path (NOTES issue 15). The down CTAs also route and
// start streaming their weights before they wait for the gate/up kernel (see moe_gemm_kernel).
//
// Tiles: decode steps route few rows to each expert, and there the weights' bytes dominate, so small batches
// use 16-row tiles (the mma's M) with narrow N (64 rows of weights per CTA, many CTAs, 4 stages: 46 KB of
// shared memory, 4 CTAs per SM; with 8 stages and 2 CTAs per SM 16 tokens took 0.314 ms, with 4 0.239, NOTES
// issue 15). They stream the weights faster than the 32-row tiles (2 CTAs per SM): 3.4 TB/s at 64
// tokens against 3.0 at 128 on the 32-row tiles (H200), so they serve up to 12 rows per expert on average,
// where an expert rarely needs a second 16-row tile (~10% of them at 12 rows, routed uniformly); batches of
// about 12-32 rows per expert (decode at batch 192-512 with top-8 of 128) use 32-row tiles so most experts'
// weights are read once; larger batches use 64 x 128 tiles, and from 128 rows per expert (prefill) 128 x 128
// tiles of 8 warps. The choice depends on the shape only (rows per expert on average), never on the routing.
//
// Every kernel here is launched with programmatic dependent launch (common.cuh): its CTAs start while the
// kernel before it drains, which at decode is a fair share of a step of ~10 short launches per layer.
// In bf16 on Hopper, fused_moe sends calls of 64 rows per expert and more to torch._grouped_mm instead (faster
// there, fused_moe.py); these tiles serve fp16 and other GPUs.
//
// Rounding follows HF's expert MLP: gate and up rounded to the model dtype, silu rounded, the product
// rounded, the down projection rounded; the top-k sum is float32 with one rounding (HF adds in bf16).
#include <algorithm>

#include "common.cuh"
#include "launchers.h"

namespace pagednb {
namespace {

constexpr int kRouteThreads = 1024;  // at most; a launch uses enough for one expert (and one pair) per thread
static_assert(kMoeMaxExperts <= kRouteThreads, "one scan element per thread");
constexpr int kBK = 64;          // reduction elements per pipeline stage
constexpr int kPad = 8;          // shared rows of kBK + 8 elements: ldmatrix reads 8 rows without bank conflicts
constexpr int kLd = kBK + kPad;

__device__ __forceinline__ int warp_inclusive_scan(int x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  return x;
}

// Block-wide inclusive scan of two counters at once (rows, tiles); blockDim.x is a multiple of 32.
__device__ __forceinline__ int2 block_inclusive_scan(int2 v, int2* warp_totals) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v.x = warp_inclusive_scan(v.x);
  v.y = warp_inclusive_scan(v.y);
  if (lane == 31) warp_totals[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int2 t = lane < (int)(blockDim.x >> 5) ? warp_totals[lane] : make_int2(0, 0);
    const int2 own = t;
    t.x = warp_inclusive_scan(t.x);
    t.y = warp_inclusive_scan(t.y);
    warp_totals[lane] = make_int2(t.x - own.x, t.y - own.y);  // exclusive prefix of each warp
  }
  __syncthreads();
  const int2 base = warp_totals[warp];
  return make_int2(v.x + base.x, v.y + base.y);
}

__global__ void __launch_bounds__(kRouteThreads) moe_route_kernel(const int64_t* __restrict__ ids, int pairs, int E,
                                                                  int bm, int* __restrict__ sorted_pairs,
                                                                  int* __restrict__ expert_offsets,
                                                                  int* __restrict__ tile_offsets) {
  __shared__ int count[kMoeMaxExperts];
  __shared__ int2 warp_totals[32];
  PAGEDNB_PDL_ENTER();
  const int tid = threadIdx.x;
  const int threads = blockDim.x;
  for (int e = tid; e < E; e += threads) count[e] = 0;
  __syncthreads();
  for (int p = tid; p < pairs; p += threads) {
    const int64_t e = __ldg(ids + p);
    if (e >= 0 && e < E) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  const int c = tid < E ? count[tid] : 0;
  const int2 own = make_int2(c, (c + bm - 1) / bm);
  const int2 incl = block_inclusive_scan(own, warp_totals);
  if (tid < E) {
    expert_offsets[tid] = incl.x - own.x;
    tile_offsets[tid] = incl.y - own.y;
    count[tid] = incl.x - own.x;  // from here on: the expert's next free row
  }
  if (tid == E - 1) {
    expert_offsets[E] = incl.x;
    tile_offsets[E] = incl.y;
  }
  __syncthreads();
  for (int p = tid; p < pairs; p += threads) {
    const int64_t e = __ldg(ids + p);
    if (e >= 0 && e < E) sorted_pairs[atomicAdd(&count[e], 1)] = p;
  }
}

// The expert whose M-tiles include `tile`: the last e with tile_offsets[e] <= tile (the offsets never
// decrease, so those e are a prefix). Each warp counts them itself, its lanes' loads in flight together: one
// trip to L2 where a binary search made log2(E) dependent ones, a fair part of a decode CTA's short life.
// Every thread of the warp must call it.
__device__ __forceinline__ int expert_of_tile(const int* __restrict__ tile_offsets, int E, int tile) {
  int below = 0;
#pragma unroll 4
  for (int e = threadIdx.x & 31; e < E; e += 32) below += __ldg(tile_offsets + e) <= tile ? 1 : 0;
  return __reduce_add_sync(0xffffffffu, below) - 1;
}

struct GemmArgs {
  const void* a;              // gate/up: hidden [T, H] (row stride a_stride); down: act [P, I] in expert order
  int64_t a_stride;
  const void* w;              // [E, w_rows, K], dense
  void* out;                  // gate/up: act [P, N]; down: ybuf [P, N] in pair order
  const int* sorted_pairs;    // the routing kernel's (unused by the direct tiles)
  const int* expert_offsets;
  const int* tile_offsets;
  const int64_t* ids;         // [P] the tokens' experts (the direct tiles route from them)
  const void* weights;        // [P] routing weights (the direct down tiles' combine)
  int weights_dtype;
  void* combined;             // [T, H] the layer's output (the direct down tiles' combine)
  int* counters;              // per down column block: down tiles done (zeroed by the direct gate/up)
  int counter_count;
  int E, topk, pairs, N, K;   // N: output columns (I for gate/up, H for down); K: reduction length
};

// ---- direct tiles: routing inside each CTA (T <= BM) ----------------------------------------------------
// When no expert can have more rows than a tile (T <= BM tokens, each routed once to an expert), tile b is
// simply the b-th smallest expert any pair is routed to, and each CTA finds its own from the ids: no routing
// kernel on the critical path of a decode step. The expert's rows are its pairs in ascending order, placed
// after the pairs of the smaller experts, so the gate/up and down CTAs agree on act's rows without talking.
constexpr int kDirectMaxPairs = 512;  // pairs a direct CTA lists (T <= 16 tokens of top-k <= 32)

struct DirectRoute {
  int expert;      // -1 when tile >= distinct
  int first_row;   // act row of the expert's first pair
  int rows;        // the expert's pairs (more than BM only where a token lists an expert twice)
  int distinct;    // experts with pairs: the live tiles
};

// One warp: a bitmap of the routed experts, the tile-th set bit, then the expert's pairs into `pairs_out`.
__device__ DirectRoute route_in_warp(const int64_t* __restrict__ ids, int pairs, int E, int tile,
                                     unsigned* bits, int* pairs_out) {
  const int lane = threadIdx.x & 31;
  const int words = (E + 31) >> 5;
  if (lane < words) bits[lane] = 0u;
  __syncwarp();
  for (int p = lane; p < pairs; p += 32) {
    const int64_t e = __ldg(ids + p);
    if (e >= 0 && e < E) atomicOr(bits + (e >> 5), 1u << (e & 31));
  }
  __syncwarp();
  const unsigned word = lane < words ? bits[lane] : 0u;
  const int n = __popc(word);
  const int incl = warp_inclusive_scan(n);
  DirectRoute r{-1, 0, 0, __shfl_sync(0xffffffffu, incl, 31)};
  if (tile >= r.distinct) return r;
  const int holder = __ffs(__ballot_sync(0xffffffffu, incl > tile)) - 1;  // the word holding the tile-th bit
  unsigned bitsleft = __shfl_sync(0xffffffffu, word, holder);
  for (int skip = tile - __shfl_sync(0xffffffffu, incl - n, holder); skip > 0; --skip) bitsleft &= bitsleft - 1u;
  r.expert = holder * 32 + __ffs(bitsleft) - 1;
  const unsigned lower_lanes = (1u << lane) - 1u;
  for (int base = 0; base < pairs; base += 32) {
    const int p = base + lane;
    const int64_t e = p < pairs ? __ldg(ids + p) : -1;
    r.first_row += __popc(__ballot_sync(0xffffffffu, e >= 0 && e < r.expert));
    const unsigned mine = __ballot_sync(0xffffffffu, e == r.expert);
    if (e == r.expert) pairs_out[r.rows + __popc(mine & lower_lanes)] = p;
    r.rows += __popc(mine);
  }
  return r;
}

// A routing weight as float32, from float32 or the model's 16-bit type (exact either way).
template <typename T>
__device__ __forceinline__ float routing_weight(const void* weights, int weights_dtype, int p) {
  return weights_dtype == kFloat32 ? __ldg(static_cast<const float*>(weights) + p)
                                   : Elem<T>::to_float(static_cast<const T*>(weights)[p]);
}

// sum_k w[t, k] * ybuf[t * topk + k] for the 16-byte vector at column col, float32, rounded once. ybuf is read
// through L2 (__ldcg): in the direct down kernel other CTAs of the same grid wrote it.
template <typename T>
__device__ __forceinline__ uint4 weighted_sum(const T* ybuf, const void* weights, int weights_dtype,
                                              const int64_t* ids, int t, int col, int H, int topk, int E) {
  constexpr int V = Elem<T>::kVec;
  float sum[V] = {};
  for (int k = 0; k < topk; ++k) {
    const int p = t * topk + k;
    const int64_t e = __ldg(ids + p);
    if (e < 0 || e >= E) continue;
    const float w = routing_weight<T>(weights, weights_dtype, p);
    float y[V];
    Elem<T>::unpack(__ldcg(reinterpret_cast<const uint4*>(ybuf + (int64_t)p * H + col)), y);
#pragma unroll
    for (int i = 0; i < V; ++i) sum[i] = fmaf(w, y[i], sum[i]);
  }
  uint4 packed;
  uint32_t* words = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
  for (int i = 0; i < V / 2; ++i) words[i] = pack2<T>(sum[2 * i], sum[2 * i + 1]);
  return packed;
}

// A CTA of WM x WN warps computes BM = WM * MI * 16 rows by BN = WN * NI * 8 weight rows. In the gate/up
// kernel each warp's first NI/2 fragments are gate rows and its last NI/2 the matching up rows, so the CTA
// writes BN / 2 act columns.
template <typename T, int WM, int WN, int MI, int NI, int STAGES, bool kGateUp>
struct MoeGemm {
  static constexpr int kThreads = WM * WN * 32;
  static constexpr int BM = WM * MI * 16;
  static constexpr int BN = WN * NI * 8;
  static constexpr int kOutCols = kGateUp ? BN / 2 : BN;
  static constexpr int kStageElems = (BM + BN) * kLd;
  static constexpr int kSmemBytes = STAGES * kStageElems * 2;
  static_assert(NI % 2 == 0, "B fragments are loaded in pairs (and split gate / up)");
};

// One expert's tile of rows: routed by the routing kernel (tile_offsets etc.), or, kDirect, by the CTA itself
// (route_in_warp). The direct down kernel also adds the top-k up (the combine): the last of a column block's
// CTAs to finish sums that block for every token.
//
// PDL: the gate/up kernel waits before it lets the down kernel launch, so when a down CTA runs, every kernel
// that wrote the routing (ids, the routing kernel's lists) has completed: the down CTA routes and starts
// streaming its weights before its own wait, which only guards act (the gate/up kernel's output).
template <typename T, int WM, int WN, int MI, int NI, int STAGES, bool kGateUp, bool kDirect>
__global__ void __launch_bounds__(WM * WN * 32) moe_gemm_kernel(const GemmArgs g) {
  using Cfg = MoeGemm<T, WM, WN, MI, NI, STAGES, kGateUp>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN;
  extern __shared__ __align__(16) unsigned char moe_smem[];
  T* smem = reinterpret_cast<T*>(moe_smem);
  __shared__ const T* a_rows[BM];  // each tile row's source row (nullptr: past the expert's rows)
  __shared__ int out_rows[BM];     // each tile row's destination row (-1: none)
  __shared__ int direct_pairs[kDirect ? kDirectMaxPairs : 1];
  __shared__ unsigned direct_bits[kDirect ? kMoeMaxExperts / 32 : 1];
  __shared__ int4 direct_route;
  __shared__ bool last_of_column;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if constexpr (kGateUp) {
    pdl_wait();
    pdl_launch_dependents();
    if (kDirect && blockIdx.x == 0 && blockIdx.y == 0)
      for (int i = tid; i < g.counter_count; i += Cfg::kThreads) g.counters[i] = 0;
  } else {
    pdl_launch_dependents();
  }

  // which expert and which of its rows this CTA serves
  const int tile = blockIdx.x;
  int e, first_row, rows, distinct = 0;
  bool live;
  if constexpr (kDirect) {
    if (warp == 0) {
      const DirectRoute r = route_in_warp(g.ids, g.pairs, g.E, tile, direct_bits, direct_pairs);
      if (lane == 0) direct_route = make_int4(r.expert, r.first_row, r.rows, r.distinct);
    }
    __syncthreads();
    const int4 r = direct_route;
    e = r.x, first_row = r.y, rows = r.z, distinct = r.w;
    live = tile < distinct;
  } else {
    e = expert_of_tile(g.tile_offsets, g.E, tile);
    live = tile < __ldg(g.tile_offsets + g.E);
  }
  const int n0 = blockIdx.y * Cfg::kOutCols;
  const int H = g.N;  // the combine's width (down only)
  auto combine_columns = [&]() {  // out[:, n0 : n0 + BN] for every token, from ybuf
    constexpr int kVecs = BN / Elem<T>::kVec;
    const int tokens = g.pairs / g.topk;
    for (int i = tid; i < tokens * kVecs; i += Cfg::kThreads) {
      const int t = i / kVecs, col = n0 + (i % kVecs) * Elem<T>::kVec;
      if (col < H)
        *reinterpret_cast<uint4*>(static_cast<T*>(g.combined) + (int64_t)t * H + col) = weighted_sum<T>(
            static_cast<const T*>(g.out), g.weights, g.weights_dtype, g.ids, t, col, H, g.topk, g.E);
    }
  };
  if (!live) {
    if (!kGateUp) pdl_wait();
    if constexpr (kDirect && !kGateUp)
      if (distinct == 0 && tile == 0) combine_columns();  // no expert routed to: zeros
    return;
  }
  const int wm = warp / WN, wn = warp % WN;
  const int w_rows_total = kGateUp ? 2 * g.N : g.N;
  const T* w_base = static_cast<const T*>(g.w) + (int64_t)e * w_rows_total * g.K;
  const T* a_base = static_cast<const T*>(g.a);

  // the weight row each shared B row holds (nullptr: past the matrix)
  auto b_row = [&](int s) -> const T* {
    int row;
    if (kGateUp) {
      const int w = s / (NI * 8), r = s % (NI * 8);
      const int j = n0 + w * NI * 4 + r % (NI * 4);
      if (j >= g.N) return nullptr;
      row = (r / (NI * 4)) * g.N + j;
    } else {
      row = n0 + s;
      if (row >= g.N) return nullptr;
    }
    return w_base + (int64_t)row * g.K;
  };

  const int k_tiles = (g.K + kBK - 1) / kBK;
  constexpr int kChunksPerRow = kBK / 8;
  auto load_a = [&](int stage, int kt) {
    T* as = smem + stage * Cfg::kStageElems;
    const int k0 = kt * kBK;
    for (int c = tid; c < BM * kChunksPerRow; c += Cfg::kThreads) {
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      const T* src = a_rows[r];
      const bool ok = src != nullptr && k0 + col < g.K;
      cp_async16(as + r * kLd + col, ok ? src + k0 + col : a_base, ok);
    }
  };
  auto load_b = [&](int stage, int kt) {
    T* bs = smem + stage * Cfg::kStageElems + BM * kLd;
    const int k0 = kt * kBK;
    for (int c = tid; c < BN * kChunksPerRow; c += Cfg::kThreads) {
      const int s = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      const T* src = b_row(s);
      const bool ok = src != nullptr && k0 + col < g.K;
      cp_async16(bs + s * kLd + col, ok ? src + k0 + col : w_base, ok);
    }
  };
  // The weights need only the expert: their first stages stream while the rows are looked up (the first
  // commit group below holds them all, so waiting for stage 0 waits for them too).
  auto prefetch_weights = [&]() {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
      if (s < k_tiles) load_b(s, s);
  };

  prefetch_weights();
  if constexpr (!kDirect) {  // looked up after the weights' loads are issued
    first_row = __ldg(g.expert_offsets + e) + (tile - __ldg(g.tile_offsets + e)) * BM;
    rows = min(BM, __ldg(g.expert_offsets + e + 1) - first_row);
  }
  if (!kGateUp) pdl_wait();  // act is the gate/up kernel's output
  T* out = static_cast<T*>(g.out);
  // Rows in chunks of BM: one chunk, except a direct tile whose expert a token lists more than once.
  const int chunk_end = kDirect ? rows : 1;  // a routed tile has at most BM rows
  for (int c0 = 0; c0 < chunk_end; c0 += BM) {
    if (c0 > 0) {
      __syncthreads();  // every warp is done with the previous chunk's rows and stages
      prefetch_weights();
    }
    for (int r = tid; r < BM; r += Cfg::kThreads) {
      const int i = c0 + r;
      if (i < rows) {
        const int m = first_row + i;
        const int pair = kDirect ? direct_pairs[i] : __ldg(g.sorted_pairs + m);
        a_rows[r] = kGateUp ? a_base + (int64_t)(pair / g.topk) * g.a_stride : a_base + (int64_t)m * g.a_stride;
        out_rows[r] = kGateUp ? m : pair;
      } else {
        a_rows[r] = nullptr;
        out_rows[r] = -1;
      }
    }
    __syncthreads();

    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < k_tiles) load_a(s, s);
      cp_async_commit();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // stage kt is in; every warp is done with stage kt - 1, which the load below reuses
      const T* as = smem + (kt % STAGES) * Cfg::kStageElems;
      const T* bs = as + BM * kLd;
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        uint32_t af[MI][4];
#pragma unroll
        for (int i = 0; i < MI; ++i)
          ldmatrix_x4(af[i], as + (wm * MI * 16 + i * 16 + (lane & 15)) * kLd + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int j = 0; j < NI; j += 2) {
          uint32_t bf[4];
          const int n = wn * NI * 8 + j * 8 + (lane >> 4) * 8 + (lane & 7);
          ldmatrix_x4(bf, bs + n * kLd + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
          for (int i = 0; i < MI; ++i) {
            mma16816<T>(acc[i][j], af[i], bf[0], bf[1]);
            mma16816<T>(acc[i][j + 1], af[i], bf[2], bf[3]);
          }
        }
      }
      const int next = kt + STAGES - 1;
      if (next < k_tiles) {
        load_a(next % STAGES, next);
        load_b(next % STAGES, next);
      }
      cp_async_commit();
    }
    cp_async_wait<0>();

    // epilogue: fragment c0, c1 at (lane / 4, 2 * (lane % 4) + {0, 1}); c2, c3 eight rows below
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = wm * MI * 16 + i * 16 + (lane >> 2) + half * 8;
        const int dest = out_rows[r];
        if (dest < 0) continue;
        T* row = out + (int64_t)dest * g.N;
        if (kGateUp) {
#pragma unroll
          for (int j = 0; j < NI / 2; ++j) {
            const int col = n0 + wn * NI * 4 + j * 8 + 2 * (lane & 3);
            if (col >= g.N) continue;
            float v[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const float gate = Elem<T>::to_float(Elem<T>::from_float(acc[i][j][half * 2 + c]));
              const float up = Elem<T>::to_float(Elem<T>::from_float(acc[i][j + NI / 2][half * 2 + c]));
              const float act =
                  Elem<T>::to_float(Elem<T>::from_float(__fdiv_rn(gate, __fadd_rn(1.f, expf(-gate)))));
              v[c] = __fmul_rn(act, up);
            }
            *reinterpret_cast<uint32_t*>(row + col) = pack2<T>(v[0], v[1]);
          }
        } else {
#pragma unroll
          for (int j = 0; j < NI; ++j) {
            const int col = n0 + wn * NI * 8 + j * 8 + 2 * (lane & 3);
            if (col < g.N)
              *reinterpret_cast<uint32_t*>(row + col) = pack2<T>(acc[i][j][half * 2], acc[i][j][half * 2 + 1]);
          }
        }
      }
    }
  }

  if constexpr (kDirect && !kGateUp) {  // the last CTA of this column block adds up the top k (threadFenceReduction)
    __threadfence();          // this CTA's ybuf writes, before its count
    __syncthreads();
    if (tid == 0) last_of_column = atomicAdd(g.counters + blockIdx.y, 1) == distinct - 1;
    __syncthreads();
    if (last_of_column) {
      __threadfence();
      combine_columns();
    }
  }
}

// out[t] = sum_k w[t, k] * ybuf[t * topk + k]: one CTA per token, 16-byte vectors along H.
template <typename T>
__global__ void __launch_bounds__(128) moe_combine_kernel(T* __restrict__ out, const T* __restrict__ ybuf,
                                                          const void* __restrict__ weights, int weights_dtype,
                                                          const int64_t* __restrict__ ids, int H, int topk, int E) {
  PAGEDNB_PDL_ENTER();
  const int t = blockIdx.x;
  constexpr int V = Elem<T>::kVec;
  for (int v = threadIdx.x; v < H / V; v += blockDim.x)
    *reinterpret_cast<uint4*>(out + (int64_t)t * H + v * V) =
        weighted_sum<T>(ybuf, weights, weights_dtype, ids, t, v * V, H, topk, E);
}

// ---- routing: softmax, top-k, renormalisation ------------------------------------------------------------
constexpr int kSelectWarps = 4;  // tokens per CTA

// A logit and its expert as one integer that orders as (logit, then lower id first): the float's bits made
// monotone in the high word (-0 counted as +0: their probabilities tie), the id's complement in the low word;
// every expert's key is distinct.
__device__ __forceinline__ uint64_t routing_key(float logit, int expert) {
  uint32_t u = __float_as_uint(logit + 0.f);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<uint64_t>(u) << 32) | (0xffffffffu - static_cast<uint32_t>(expert));
}

__device__ __forceinline__ uint64_t warp_max(uint64_t x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const uint64_t y = __shfl_xor_sync(0xffffffffu, x, off);
    x = y > x ? y : x;
  }
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// One warp per token: k rounds of a warp-wide max over the keys below the last pick (lane r keeps pick r),
// then softmax(logits)[pick] = exp(l - max) / sum exp(l_j - max) in float32, divided by the picks' sum when
// renormalising, rounded to L when the architecture rounds (Qwen3-MoE) or stored as float32 (Mixtral).
template <typename L>
__global__ void __launch_bounds__(kSelectWarps * 32) moe_select_kernel(const L* __restrict__ logits,
                                                                       int64_t row_stride, int T, int E, int topk,
                                                                       bool renormalize, bool round_weights,
                                                                       void* __restrict__ weights,
                                                                       int64_t* __restrict__ ids) {
  extern __shared__ float rows[];  // [kSelectWarps][E]: each warp's row as float32
  PAGEDNB_PDL_ENTER();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x * kSelectWarps + warp;
  if (t >= T) return;
  float* row = rows + warp * E;
  for (int e = lane; e < E; e += 32) row[e] = Elem<L>::to_float(logits[(int64_t)t * row_stride + e]);
  __syncwarp();
  uint64_t last = ~0ull, mine = 0;
  for (int r = 0; r < topk; ++r) {
    uint64_t best = 0;
    for (int e = lane; e < E; e += 32) {
      const uint64_t key = routing_key(row[e], e);
      if (key < last && key > best) best = key;
    }
    last = warp_max(best);
    if (lane == r) mine = last;
  }
  const float top = row[0xffffffffu - static_cast<uint32_t>(__shfl_sync(0xffffffffu, mine, 0))];  // the max
  float sum = 0.f;
  for (int e = lane; e < E; e += 32) sum += expf(row[e] - top);
  sum = warp_sum(sum);
  const int expert = static_cast<int>(0xffffffffu - static_cast<uint32_t>(mine));
  float p = lane < topk ? __fdiv_rn(expf(row[expert] - top), sum) : 0.f;
  if (renormalize) p = __fdiv_rn(p, warp_sum(p));
  if (lane < topk) {
    const int64_t slot = (int64_t)t * topk + lane;
    ids[slot] = expert;
    if (round_weights) static_cast<L*>(weights)[slot] = Elem<L>::from_float(p);
    else static_cast<float*>(weights)[slot] = p;
  }
}

// ---- workspace ----------------------------------------------------------------------------------------
int64_t align256(int64_t n) { return (n + 255) / 256 * 256; }

struct Workspace {
  int* sorted_pairs;    // [P]
  int* expert_offsets;  // [E + 1]
  int* tile_offsets;    // [E + 1]
  int* counters;        // [H / 8]: at least one per down column block
  void* act;            // [P, I]
  void* ybuf;           // [P, H]
  int64_t bytes;
};

Workspace carve(void* base, int T, int H, int I, int E, int topk) {
  const int64_t P = (int64_t)T * topk;
  char* p = static_cast<char*>(base);
  Workspace w{};
  int64_t at = 0;
  auto take = [&](int64_t n) { char* q = p ? p + at : nullptr; at += align256(n); return q; };
  w.sorted_pairs = reinterpret_cast<int*>(take(P * 4));
  w.expert_offsets = reinterpret_cast<int*>(take((int64_t)(E + 1) * 4));
  w.tile_offsets = reinterpret_cast<int*>(take((int64_t)(E + 1) * 4));
  w.counters = reinterpret_cast<int*>(take((int64_t)(H / 8) * 4));
  w.act = take(P * I * 2);
  w.ybuf = take(P * H * 2);
  w.bytes = at;
  return w;
}

// ---- launch ----------------------------------------------------------------------------------------------
// Dynamic shared memory above 48 KB, static included, needs the kernel's opt-in.
template <typename Kernel>
int prepare(Kernel kernel, int smem_bytes) {
  cudaFuncAttributes attr{};
  const cudaError_t rc = cudaFuncGetAttributes(&attr, kernel);
  if (rc != cudaSuccess) return (int)rc;
  if (smem_bytes + attr.sharedSizeBytes <= 48 * 1024) return 0;
  return (int)cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
}

template <typename T, int WM, int WN, int MI, int NI, int STAGES, bool kGateUp, bool kDirect>
int launch_gemm(const GemmArgs& g, int64_t tiles, cudaStream_t st) {
  using Cfg = MoeGemm<T, WM, WN, MI, NI, STAGES, kGateUp>;
  auto kernel = moe_gemm_kernel<T, WM, WN, MI, NI, STAGES, kGateUp, kDirect>;
  static const int prepared = prepare(kernel, Cfg::kSmemBytes);  // once per instantiation, before any capture
  if (prepared != 0) return prepared;
  const int64_t col_blocks = (g.N + Cfg::kOutCols - 1) / Cfg::kOutCols;
  if (tiles > 0x7fffffff || col_blocks > 65535) return -1;
  return launch_pdl(kernel, dim3((unsigned)tiles, (unsigned)col_blocks), dim3(Cfg::kThreads), Cfg::kSmemBytes, st, g);
}

GemmArgs gate_up_args(const FusedMoeArgs& a, const Workspace& w) {
  return GemmArgs{a.hidden, a.hidden_stride, a.w13, w.act, w.sorted_pairs, w.expert_offsets, w.tile_offsets,
                  a.topk_ids, a.topk_weights, a.weights_dtype, a.out, w.counters, 0, a.E, a.topk, a.T * a.topk, a.I,
                  a.H};
}

GemmArgs down_args(const FusedMoeArgs& a, const Workspace& w) {
  return GemmArgs{w.act, a.I, a.w2, w.ybuf, w.sorted_pairs, w.expert_offsets, w.tile_offsets, a.topk_ids,
                  a.topk_weights, a.weights_dtype, a.out, w.counters, 0, a.E, a.topk, a.T * a.topk, a.H, a.I};
}

// Routing kernel, both GEMMs with one tile shape (BM must match the routing kernel's), the combine.
template <typename T, int WM, int WN, int MI, int NI, int STAGES>
int launch_routed_expert_mlp(const FusedMoeArgs& a, const Workspace& w, cudaStream_t st) {
  constexpr int BM = MoeGemm<T, WM, WN, MI, NI, STAGES, true>::BM;
  const int pairs = a.T * a.topk;
  // one thread per expert at least (the scan), per pair where there are few: a decode step's routing
  // is a few hundred threads, not 1024 with its barriers
  const int threads = std::min(kRouteThreads, (std::max(a.E, pairs) + 31) / 32 * 32);
  int rc = launch_pdl(moe_route_kernel, dim3(1), dim3(threads), 0, st, a.topk_ids, pairs, a.E, BM, w.sorted_pairs,
                      w.expert_offsets, w.tile_offsets);
  if (rc != 0) return rc;
  // the most M-tiles any routing can need: one partial tile per expert with rows, the rest full
  const int64_t tiles = std::min<int64_t>(pairs, (pairs + BM - 1) / BM + std::min(a.E, pairs));
  rc = launch_gemm<T, WM, WN, MI, NI, STAGES, true, false>(gate_up_args(a, w), tiles, st);
  if (rc != 0) return rc;
  rc = launch_gemm<T, WM, WN, MI, NI, STAGES, false, false>(down_args(a, w), tiles, st);
  if (rc != 0) return rc;
  return launch_pdl(moe_combine_kernel<T>, dim3(a.T), dim3(128), 0, st, static_cast<T*>(a.out),
                    static_cast<const T*>(w.ybuf), a.topk_weights, a.weights_dtype, a.topk_ids, a.H, a.topk, a.E);
}

// T <= BM: two launches, the direct tiles (each CTA routes itself; the down tiles combine).
template <typename T, int WM, int WN, int MI, int NI, int STAGES>
int launch_direct_expert_mlp(const FusedMoeArgs& a, const Workspace& w, cudaStream_t st) {
  using Down = MoeGemm<T, WM, WN, MI, NI, STAGES, false>;
  const int pairs = a.T * a.topk;
  const int64_t tiles = std::min(a.E, pairs);  // one per routed expert at most
  GemmArgs up = gate_up_args(a, w), down = down_args(a, w);
  up.counter_count = down.counter_count = (a.H + Down::kOutCols - 1) / Down::kOutCols;  // <= H / 8
  const int rc = launch_gemm<T, WM, WN, MI, NI, STAGES, true, true>(up, tiles, st);
  if (rc != 0) return rc;
  return launch_gemm<T, WM, WN, MI, NI, STAGES, false, true>(down, tiles, st);
}

template <typename T>
int launch_fused_moe_dtype(const FusedMoeArgs& a, cudaStream_t st) {
  const Workspace w = carve(a.workspace, a.T, a.H, a.I, a.E, a.topk);
  const int64_t pairs = (int64_t)a.T * a.topk;
  // rows per expert on average: under 12 (decode) -> 16 x 64 tiles, many CTAs streaming weights 3 stages ahead
  // (routed inside each CTA up to 16 tokens); up to a 32-row tile (large decode batches) -> 32 x 128, so an
  // expert's weights are read once; more (prefill) -> 64 x 128, and from 128 rows 128 x 128 tiles of 8 warps
  // (twice the MMAs per byte of shared memory)
  const int64_t rows_per_expert = pairs / a.E;
  if (a.T <= MoeGemm<T, 1, 4, 1, 2, 4, true>::BM && pairs <= kDirectMaxPairs)
    return launch_direct_expert_mlp<T, 1, 4, 1, 2, 4>(a, w, st);
  return rows_per_expert < 12    ? launch_routed_expert_mlp<T, 1, 4, 1, 2, 4>(a, w, st)
         : rows_per_expert < 32  ? launch_routed_expert_mlp<T, 2, 2, 1, 8, 4>(a, w, st)
         : rows_per_expert < 128 ? launch_routed_expert_mlp<T, 2, 2, 2, 8, 3>(a, w, st)
                                 : launch_routed_expert_mlp<T, 2, 4, 4, 4, 3>(a, w, st);
}

}  // namespace

int64_t moe_workspace_bytes(int T, int H, int I, int E, int topk) {
  return carve(nullptr, T, H, I, E, topk).bytes;
}

int launch_moe_select_experts(int dtype, const MoeSelectArgs& a, void* stream) {
  if (a.T <= 0) return 0;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const dim3 grid((a.T + kSelectWarps - 1) / kSelectWarps), block(kSelectWarps * 32);
  const size_t smem = kSelectWarps * a.E * sizeof(float);  // 16 KB at most (kMoeMaxExperts)
  switch (dtype) {
    case kFloat16:
      return launch_pdl(moe_select_kernel<__half>, grid, block, smem, st, static_cast<const __half*>(a.logits),
                        a.row_stride, a.T, a.E, a.topk, a.renormalize, a.round_weights, a.weights, a.ids);
    case kBFloat16:
      return launch_pdl(moe_select_kernel<__nv_bfloat16>, grid, block, smem, st,
                        static_cast<const __nv_bfloat16*>(a.logits), a.row_stride, a.T, a.E, a.topk, a.renormalize,
                        a.round_weights, a.weights, a.ids);
    default: return -1;
  }
}

int launch_fused_moe(int dtype, const FusedMoeArgs& a, void* stream) {
  if (a.T <= 0) return 0;  // the shape is checked by bindings.cpp
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kFloat16: return launch_fused_moe_dtype<__half>(a, st);
    case kBFloat16: return launch_fused_moe_dtype<__nv_bfloat16>(a, st);
    default: return -1;
  }
}

}  // namespace pagednb
