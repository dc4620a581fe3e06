"""Paged attention on pagednb's own CUDA kernels (kernels_cuda/, built and loaded by pagednb/kernels).

Per step and layer: `write_kv` scatters the new K/V rows into their slots (one kernel; slot -1 is
skipped); `attend` runs
  * the row kernel (CUDA cores, one CTA per query row x kv head x split-K partition, GQA-aware) for
    decode rows; when a row's keys are split across partitions, the last partition to finish merges
    the others' partials (a per-(row, kv head) counter in an array the backend keeps zeroed), so a
    split step is still one launch (the kernels' SPLIT instantiations: a one-partition step, every large
    batch, runs kernels without the merge); a decode step of ORDER_MIN_ROWS rows or more launches its rows
    longest first (`_row_order`: one device sort per step, so the launch does not end on a long row running
    alone; the tensor-core kernel below launches in the same order); in float32 it serves every row (the test
    path). For bf16/fp16
    models with 4-16 query heads per kv head at head_dim 64 (Llama 3.2 1B/3B) the decode rows run on
    tensor cores instead (the kv head's query heads as the rows of an mma tile;
    kernels_cuda/decode_group_mma.cuh), with the same split-K merge;
  * the tensor-core prefill kernel (mma.sync, FlashAttention-2 style) for sequences with more than one
    new token (prefill chunks, prefix hits) in bf16/fp16.
Both kernels read the same metadata and pick their own sequences, so a mixed batch is two launches.
An fp8 cache (float8_e4m3fn, attention/kv_quant.py) under a bf16/fp16 model: the cache write quantises,
the row and prefill kernels convert fp8 to float / to the model's type as they read, with the layer's
k_scale and v_scale as plain kernel arguments (captured by the decode CUDA graphs); its decode rows with
4-16 query heads per kv head take the tensor-core kernel at head_dim 64 and 128, others the row kernel
(16 fp8 values per 16-byte load; row variant 3 pairs kv heads per CTA at head_dim 128, <= 2 query heads per kv head).
Under a float32 model an fp8 cache runs on the reference.
`attend_rope` serves a decode-only step over an fp8 cache on the tensor-core kernel with the step's q/k norm, rotary
embedding and cache write done in the decode CTAs' prologue (kernels_cuda/decode.cuh, FusedRope) instead of the
model's qk_norm_rope launch, where that measured faster (_fusion_pays); anything else it declines (None).
Anything the kernels do not cover (another dtype, head_dim or block size) goes to the reference.
"""
from __future__ import annotations

import copy
import ctypes
import os
import warnings

import torch

from pagednb.attention.backend import AttentionBackend, AttentionMetadata, RopeInputs
from pagednb.attention.kv_quant import is_fp8
from pagednb.attention.torch_ref import TorchReferenceBackend
from pagednb.kernels import AttnParams, check_status, current_stream, dtype_codes, head_dims, load_error, load_kernels
from pagednb.kernels.qk_rope_rows import qk_rope_rows_fit

LOG2E = 1.4426950408889634
# Decode steps of at least this many rows launch their rows longest first (row and tensor-core kernels; one device
# sort per step, replayed by the decode graphs on each step's lengths). Fewer rows are one wave of CTAs (split-K
# fills it) where the order hardly matters and a batch-1 step would pay the sort's launches.
ORDER_MIN_ROWS = 32
# Decode rows run on the tensor-core kernel for 4-16 query heads per kv head at head_dim 64 (16-bit or fp8 cache)
# and for 2-16 at head_dim 128 over an fp8 cache (launchers.h group_mma_applies), else on the row kernel. Over an
# fp8 cache with 2 query heads per kv head (Qwen3-0.6B) the tensor-core kernel, launched longest first, ran the
# standard workload 5.9% faster than the row kernel (benchmarks/NOTES.md, issue 19, ninth round). Variant 5 is 4 with
# that kernel's two-kv-head CTA on a lean ring at head_dim 128 (3 CTAs per SM instead of 2): its decode attention 5%
# faster, whole runs 1.5% (sixteenth round).
DEFAULT_ROW_VARIANT = 5
ROW_VARIANTS = range(6)
# attend_rope fuses the q/k norm + RoPE + cache write into one-partition decode launches of at most this many waves
# of resident CTAs (_fusion_pays): over more, each CTA's prologue costs more than the separate launch it saves.
DEFAULT_FUSE_ROPE_WAVES = 1.0
# ... and into split-K launches whose CTAs (rows x kv heads x partitions) come to this band of waves: measured faster
# per layer from 4 to 48 rows (Qwen3-0.6B heads, 0.97-1.45 waves), slower at batch 1 (0.12 waves: too few CTAs for
# the separate launch's work to cost them anything)
DEFAULT_FUSE_ROPE_SPLIT_WAVES = (0.5, 1.5)
# The decode kernels' grid holds rows in blocks of this many (gridDim.y's limit; decode.cuh's kMaxGridRows): a sorted
# launch fits one block, and split-K counters cover whole blocks.
GRID_ROWS = 65535
# The split-K counter array's smallest size: every decode CUDA graph's rows x kv heads fits, so it is
# allocated once, before the first capture.
MIN_PART_COUNTERS = 1 << 16


def row_variant_from_env() -> int:
    """PAGEDNB_ROW_VARIANT (an A/B knob of benchmarks/whole_run_ab.py), else DEFAULT_ROW_VARIANT."""
    raw = os.environ.get("PAGEDNB_ROW_VARIANT", "").strip()
    if not raw:
        return DEFAULT_ROW_VARIANT
    if not raw.isdigit() or int(raw) not in ROW_VARIANTS:
        raise ValueError(f"PAGEDNB_ROW_VARIANT must be one of {list(ROW_VARIANTS)}, got {raw!r}")
    return int(raw)


def _waves_from_env() -> float:
    """PAGEDNB_FUSE_ROPE_WAVES (an A/B knob of benchmarks/whole_run_ab.py), else DEFAULT_FUSE_ROPE_WAVES."""
    raw = os.environ.get("PAGEDNB_FUSE_ROPE_WAVES", "").strip()
    if not raw:
        return DEFAULT_FUSE_ROPE_WAVES
    try:
        waves = float(raw)
    except ValueError:
        waves = -1.0
    if not waves >= 0:
        raise ValueError(f"PAGEDNB_FUSE_ROPE_WAVES must be a number of waves >= 0, got {raw!r}")
    return waves


def _split_band_from_env() -> tuple[float, float] | None:
    """PAGEDNB_FUSE_ROPE_SPLIT (an A/B knob of benchmarks/whole_run_ab.py): "0" (no split launch fuses), "1" (every
    one) or "LO,HI" (waves), else DEFAULT_FUSE_ROPE_SPLIT_WAVES."""
    raw = os.environ.get("PAGEDNB_FUSE_ROPE_SPLIT", "").strip()
    if not raw:
        return DEFAULT_FUSE_ROPE_SPLIT_WAVES
    if raw in ("0", "1"):
        return None if raw == "0" else (0.0, float("inf"))
    try:
        lo, hi = (float(x) for x in raw.split(","))
    except ValueError:
        lo = hi = -1.0
    if not 0 <= lo <= hi:
        raise ValueError(f"PAGEDNB_FUSE_ROPE_SPLIT must be 0, 1 or LO,HI waves with 0 <= LO <= HI, got {raw!r}")
    return lo, hi


class _StepPlan:
    """What the kernels need from one step's metadata, computed once and shared by every layer."""

    __slots__ = ("rows", "num_decode", "has_chunk", "max_query_len", "max_seq_len", "num_seqs", "qsl",
                 "seq_lens", "block_tables", "row_plans", "order", "fusions")

    def __init__(self, md: AttentionMetadata) -> None:
        starts = md.query_start_loc_cpu
        self.num_seqs = md.num_seqs
        self.rows = int(starts[-1])
        self.num_decode = sum(1 for i in range(self.num_seqs) if starts[i + 1] - starts[i] == 1)
        self.max_query_len = max((starts[i + 1] - starts[i] for i in range(self.num_seqs)), default=0)
        self.has_chunk = self.max_query_len > 1
        self.max_seq_len = max(md.seq_lens_cpu, default=0)
        self.qsl = _int32(md.query_start_loc)
        self.seq_lens = _int32(md.seq_lens)
        self.block_tables = _tables(md.block_tables)
        self.row_plans: dict = {}  # split plans by launch configuration: (partitions, partition tokens, head groups)
        self.order: torch.Tensor | None | object = _UNSORTED  # the decode launch order, once sorted (_launch_order)
        self.fusions: dict = {}  # attend_rope's decisions by layer configuration: every layer of the step asks

    def with_block_tables(self, block_tables: torch.Tensor) -> _StepPlan:
        plan = copy.copy(self)  # row plans shared: they depend on the batch, not on the tables
        plan.block_tables = _tables(block_tables)
        return plan


_UNSORTED = object()


def _tables(block_tables: torch.Tensor) -> torch.Tensor:
    tables = _int32(block_tables)
    if tables.dim() != 2 or (tables.shape[1] > 1 and tables.stride(1) != 1):
        tables = tables.contiguous()
    return tables


def _plan_of(md: AttentionMetadata) -> _StepPlan:
    """A layer group's metadata (a hybrid model) differs from the step's only in its block table: its plan is
    the step's, planned once, with that table."""
    if md.base is None:
        return _StepPlan(md)
    base = getattr(md.base, "_cuda_plan", None)
    if base is None:
        base = md.base._cuda_plan = _StepPlan(md.base)
    return base.with_block_tables(md.block_tables)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


class CudaPagedBackend(AttentionBackend):
    """The engine's attention on a CUDA GPU."""

    name = "cuda"

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        lib = lib if lib is not None else load_kernels()
        if lib is None:
            raise RuntimeError(f"pagednb's CUDA kernels are unavailable: {load_error()}")
        if lib.pagednb_params_size() != ctypes.sizeof(AttnParams):
            raise RuntimeError("kernels_cuda/launchers.h and pagednb/kernels/abi.AttnParams disagree")
        self._lib = lib
        self._dtype_codes = dtype_codes(lib)
        self._head_dims = head_dims(lib)
        self._reference = TorchReferenceBackend()
        self._warned: set[str] = set()
        self._num_sms: dict[int, int] = {}
        self._part_counters: dict[int, list[torch.Tensor]] = {}
        # decode rows (launchers.h): DEFAULT_ROW_VARIANT, or for benchmarks and tests (PAGEDNB_ROW_VARIANT sets it
        # for A/B runs of a whole engine) 4 (as 5 with the fp8 tensor-core kernel's two-kv-head CTA on its full
        # ring: 2 CTAs per SM), 2 (as 4 but for an fp8 cache with 2-3 query heads per kv head at head_dim 128: the
        # row kernel), 3 (as 2, with two kv heads per row-kernel CTA there), 1 (the cp.async-pipelined row kernel
        # (bf16/fp16)) or 0 (direct loads)
        self.row_variant = row_variant_from_env()
        # decode rows longest first at ORDER_MIN_ROWS and more (False: in batch order; PAGEDNB_LONGEST_FIRST=0
        # sets it for A/B runs of a whole engine, as PAGEDNB_PDL=0 does for programmatic dependent launch)
        self.longest_first = os.environ.get("PAGEDNB_LONGEST_FIRST", "1") != "0"
        # decode CTAs look up their row and copy the keys of earlier steps before their PDL wait, while the q/k
        # norm + RoPE + cache write kernel before them runs (decode.cuh, Keys; PAGEDNB_EARLY_KEYS=0: after it,
        # for A/B runs of a whole engine)
        self.early_keys = os.environ.get("PAGEDNB_EARLY_KEYS", "1") != "0"
        # decode-only steps on the kernel that fuses do the q/k norm + RoPE + cache write in the decode launch
        # (attend_rope; PAGEDNB_FUSE_ROPE=0: a launch of their own, for A/B runs of a whole engine)
        self.fuse_rope = os.environ.get("PAGEDNB_FUSE_ROPE", "1") != "0"
        # where it fuses (_fusion_pays): one-partition launches of up to this many waves of resident CTAs, and split
        # launches whose CTAs come to this band of waves (None: none) (PAGEDNB_FUSE_ROPE_WAVES /
        # PAGEDNB_FUSE_ROPE_SPLIT: A/B knobs)
        self.fuse_rope_waves = _waves_from_env()
        self.fuse_rope_split = _split_band_from_env()
        self._waves: dict[tuple, int] = {}
        # A/B knobs of benchmarks/kernels.py --only workload (None: the planner's choice): one-partition launches
        # (large batches) split into partitions of split_tokens where the plan's longest row is longer; split
        # launches (small batches) in partitions of tail_tokens
        self.split_tokens: int | None = None
        self.tail_tokens: int | None = None

    # ---- support ---------------------------------------------------------------------------------
    def unsupported_reason(self, dtype: torch.dtype, head_dim: int, block_size: int, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"device {device}"
        if dtype not in self._dtype_codes:
            return f"dtype {dtype}"
        if head_dim not in self._head_dims:
            return f"head_dim {head_dim} (supported: {self._head_dims})"
        if block_size < 1 or block_size & (block_size - 1):
            return f"block_size {block_size} (a power of two is needed)"
        return None

    def _fallback(self, reason: str) -> TorchReferenceBackend:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"pagednb CUDA attention: {reason} is not supported by the kernels; "
                          "those layers use the reference backend", RuntimeWarning, stacklevel=3)
        return self._reference

    def _fp8_reason(self, query_dtype: torch.dtype, kv_cache: torch.Tensor) -> str | None:
        """Why an fp8 cache cannot be on the kernels with this query dtype (None: it can, or no fp8 cache)."""
        if is_fp8(kv_cache.dtype) and query_dtype not in (torch.bfloat16, torch.float16):
            return f"an fp8 KV cache under a {str(query_dtype).removeprefix('torch.')} model (bf16/fp16 only)"
        return None

    # ---- cache write -----------------------------------------------------------------------------
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        reason = (self._fp8_reason(key.dtype, kv_cache) or
                  (None if kv_cache.device.type == "cuda" and kv_cache.is_contiguous()
                   else "a non-contiguous or non-CUDA cache"))
        if reason is not None:
            return self._fallback(reason).write_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale)
        n = min(slot_mapping.shape[0], key.shape[0])
        if n == 0:
            return
        fp8 = is_fp8(kv_cache.dtype)
        row_dtype = key.dtype if fp8 else kv_cache.dtype  # an fp8 cache quantises the 16-bit rows as it writes
        if key.dtype != row_dtype:
            key = key.to(row_dtype)
        if value.dtype != row_dtype:
            value = value.to(row_dtype)
        if key.stride(-1) != 1 or key.stride(-2) != head_dim:
            key = key.contiguous()
        if value.stride(-1) != 1 or value.stride(-2) != head_dim:
            value = value.contiguous()
        if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
            slot_mapping = slot_mapping.to(torch.int64).contiguous()
        es = key.element_size()
        if fp8 and (key.data_ptr() | key.stride(0) * es) % 16:  # the quantising write reads 16-byte vectors
            key = key.clone()
        if fp8 and (value.data_ptr() | value.stride(0) * es) % 16:
            value = value.clone()
        row_bytes = num_kv_heads * head_dim * es
        cache_row_bytes = num_kv_heads * head_dim * kv_cache.element_size()
        rc = self._lib.pagednb_write_kv(
            key.data_ptr(), value.data_ptr(), key.stride(0) * es, value.stride(0) * es, kv_cache.data_ptr(),
            kv_cache.shape[1] * kv_cache.shape[2] * cache_row_bytes, slot_mapping.data_ptr(), n, row_bytes,
            self._dtype_codes[key.dtype] if fp8 else -1, k_scale, v_scale, current_stream(kv_cache))
        self._check(rc, "write_kv")

    # ---- attention -------------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, sliding_window: int | None, softcap: float | None = None,
               k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        head_dim = query.shape[2]
        reason = self._attend_reason(query, kv_cache)
        if reason is not None:
            return self._fallback(reason).attend(query, kv_cache, metadata, scale, sliding_window, softcap,
                                                 k_scale, v_scale)
        plan = self._plan(metadata)
        out = self._output(query, plan)
        if plan.rows == 0 or plan.num_seqs == 0:
            return out
        vec = 16 // query.element_size()
        if (query.stride(-1) != 1 or query.stride(0) % vec or query.stride(1) % vec or query.data_ptr() % 16):
            query = query.contiguous()
        p = self._params(query, kv_cache, plan, scale, sliding_window, softcap, k_scale, v_scale)
        p.out = out.data_ptr()
        rows_on_cuda_cores = query.dtype == torch.float32 or not plan.has_chunk
        if rows_on_cuda_cores or plan.num_decode:
            self._launch_rows(p, plan, query, decode_only=0 if rows_on_cuda_cores else 1)
        if not rows_on_cuda_cores:
            p.max_query_len = plan.max_query_len
            self._check(self._lib.pagednb_prefill_attention(self._dtype_codes[query.dtype], head_dim,
                                                            ctypes.byref(p), current_stream(query)),
                        "prefill attention")
        return out

    def attend_rope(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float, sliding_window: int | None, softcap: float | None,
                    k_scale: float, v_scale: float, rope: RopeInputs) -> torch.Tensor | None:
        """Decode-only steps on the decode kernel that fuses (launchers.h decode_fuses_rope: the tensor-core kernel
        over an fp8 cache): each decode CTA norms and rotates its query heads itself and writes the new token's K/V
        into the cache before reading it (kernels_cuda/decode.cuh, FusedRope), which saves qk_norm_rope's launch per
        layer. None for anything else (a prefill chunk in the step, another kernel, unaligned rows,
        PAGEDNB_FUSE_ROPE=0)."""
        if not self.fuse_rope or not is_fp8(kv_cache.dtype):  # (the cheap refusals first: every layer asks)
            return None
        plan = self._plan(metadata)
        if plan.has_chunk or plan.rows != plan.num_seqs or plan.rows == 0:
            return None
        layer = (query.dtype, query.shape[1:], kv_cache.shape[2:], sliding_window, bool(softcap), self.row_variant,
                 self.fuse_rope_waves, self.fuse_rope_split)
        fuses = plan.fusions.get(layer)
        if fuses is False:  # decided for an earlier layer of the step
            return None
        slots = metadata.slot_mapping
        if (not qk_rope_rows_fit(query, key, rope.cos, rope.sin, rope.q_weight, rope.k_weight, value)
                or key.shape[1] != value.shape[1] or slots.dtype != torch.int64 or not slots.is_contiguous()
                or slots.shape[0] < plan.rows):
            return None
        p = self._params(query, kv_cache, plan, scale, sliding_window, softcap, k_scale, v_scale)
        if fuses is None:
            fuses = plan.fusions[layer] = self._fuses(query, kv_cache, p, plan, bool(softcap))
            if not fuses:
                return None
        out = self._output(query, plan)
        p.out = out.data_ptr()
        p.fuse_rope = 1
        p.k_new, p.k_stride_tok, p.k_stride_head = key.data_ptr(), key.stride(0), key.stride(1)
        p.v_new, p.v_stride_tok, p.v_stride_head = value.data_ptr(), value.stride(0), value.stride(1)
        p.rope_cos, p.rope_sin, p.cos_sin_stride = rope.cos.data_ptr(), rope.sin.data_ptr(), rope.cos.stride(0)
        if rope.q_weight is not None:
            p.q_norm_weight, p.k_norm_weight = rope.q_weight.data_ptr(), rope.k_weight.data_ptr()
        p.norm_eps = rope.eps
        p.norm_offset, p.norm_in_float32 = (0.0, 0) if rope.weight_offset is None else (rope.weight_offset, 1)
        p.slots = slots.data_ptr()
        self._launch_rows(p, plan, query, decode_only=0)
        return out

    def _fuses(self, query: torch.Tensor, kv_cache: torch.Tensor, p: AttnParams, plan: _StepPlan,
               softcapped: bool) -> bool:
        """Whether this step's layers of this configuration take the fused launch: the kernels serve them, the decode
        kernel fuses, and the policy says it pays."""
        head_dim = query.shape[2]
        dtype = self._dtype_codes[query.dtype]
        return (self._attend_reason(query, kv_cache) is None
                and bool(self._lib.pagednb_decode_fuses_rope(dtype, head_dim, p.G, self.row_variant, 1, int(softcapped)))
                and self._fusion_pays(dtype, head_dim, p, self._split_plan(p, plan, query, 0)[0], query.device))

    def _fusion_pays(self, dtype: int, head_dim: int, p: AttnParams, partitions: int, device: torch.device) -> bool:
        """Where the fused launch measured faster than the separate q/k norm + RoPE launch and decode launch: a
        one-partition launch of at most fuse_rope_waves waves of CTAs, a split launch whose CTAs come to the
        fuse_rope_split band of waves. Each fused CTA does its prologue after its wait, where the separate kernel's
        work ran beside the decode CTAs' early key copies, so over many waves the prologues cost more than the launch
        they save, and a launch of far less than a wave (batch 1) has too few CTAs to hide that work behind
        (benchmarks/NOTES.md, issue 19's fifteenth and sixteenth rounds)."""
        wave = self._wave(dtype, head_dim, p, device)
        if partitions > 1:
            band = self.fuse_rope_split
            return band is not None and band[0] * wave <= p.num_rows * p.Hkv * partitions <= band[1] * wave
        return p.num_rows * p.Hkv <= self.fuse_rope_waves * wave

    def _wave(self, dtype: int, head_dim: int, p: AttnParams, device: torch.device) -> int:
        """Resident decode CTAs on the whole GPU, counted per kv head (a two-head CTA counts as two)."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        key = (dtype, head_dim, p.G, p.row_variant, idx)
        wave = self._waves.get(key)
        if wave is None:
            wave = self._waves[key] = self._sm_count(device) * self._lib.pagednb_decode_resident_ctas(
                dtype, head_dim, p.G, p.row_variant, p.cache_fp8)
        return wave

    def _sm_count(self, device: torch.device) -> int:
        """The device's SMs (one property query per device)."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        sms = self._num_sms.get(idx)
        if sms is None:
            sms = self._num_sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        return sms

    def _attend_reason(self, query: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
        """Why attend must go to the reference for these inputs (None: the kernels serve them)."""
        num_heads, head_dim = query.shape[1:]
        block_size, num_kv_heads = kv_cache.shape[2:4]
        fp8 = is_fp8(kv_cache.dtype)
        reason = self.unsupported_reason(query.dtype, head_dim, block_size, query.device)
        if reason is None and fp8:
            reason = self._fp8_reason(query.dtype, kv_cache)
        if reason is None and ((kv_cache.dtype != query.dtype and not fp8) or not kv_cache.is_contiguous()
                               or kv_cache.data_ptr() % 16):
            reason = "a cache whose dtype differs from the query's, or a non-contiguous cache"
        if reason is None and num_heads % num_kv_heads:
            reason = f"{num_heads} query heads over {num_kv_heads} kv heads"
        return reason

    @staticmethod
    def _plan(metadata: AttentionMetadata) -> _StepPlan:
        plan = getattr(metadata, "_cuda_plan", None)
        if plan is None:
            plan = _plan_of(metadata)
            metadata._cuda_plan = plan  # the metadata is built once per step (and layer group), shared by its layers
        return plan

    @staticmethod
    def _output(query: torch.Tensor, plan: _StepPlan) -> torch.Tensor:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if plan.rows < query.shape[0]:
            out[plan.rows:].zero_()  # padding rows past the last sequence, as the reference does
        return out

    def _params(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan, scale: float,
                sliding_window: int | None, softcap: float | None, k_scale: float, v_scale: float) -> AttnParams:
        """The kernels' arguments for this layer and step, but for the output and the decode launch's split plan."""
        num_heads, head_dim = query.shape[1:]
        block_size, num_kv_heads = kv_cache.shape[2:4]
        fp8 = is_fp8(kv_cache.dtype)
        p = AttnParams()
        p.q, p.q_stride_tok, p.q_stride_head = query.data_ptr(), query.stride(0), query.stride(1)
        p.cache, p.v_offset = kv_cache.data_ptr(), kv_cache[0].numel()
        p.qsl, p.seq_lens, p.block_tables = plan.qsl.data_ptr(), plan.seq_lens.data_ptr(), plan.block_tables.data_ptr()
        p.bt_stride = plan.block_tables.stride(0) if plan.block_tables.dim() == 2 else 0
        p.num_seqs, p.num_rows = plan.num_seqs, plan.rows
        p.H, p.Hkv, p.G = num_heads, num_kv_heads, num_heads // num_kv_heads
        p.bs_log2 = block_size.bit_length() - 1
        p.window = int(sliding_window) if sliding_window else 0
        p.scale_log2 = scale * LOG2E
        p.softcap_log2 = softcap * LOG2E if softcap else 0.0
        p.row_variant = self.row_variant
        p.cache_fp8 = int(fp8)
        p.k_scale, p.v_scale = (k_scale, v_scale) if fp8 else (1.0, 1.0)
        return p

    def _split_plan(self, p: AttnParams, plan: _StepPlan, query: torch.Tensor,
                    decode_only: int) -> tuple[int, int, int]:
        """(partitions, partition tokens, head groups) of this layer's decode launch, planned once per step."""
        head_dim = query.shape[2]
        dtype, fp8 = self._dtype_codes[query.dtype], bool(p.cache_fp8)
        key = (dtype, head_dim, p.G, p.Hkv, p.window, decode_only, self.row_variant, fp8)
        split = plan.row_plans.get(key)
        if split is None:
            split = plan.row_plans[key] = self._row_plan(
                dtype, head_dim, p.G, p.Hkv, self.row_variant, fp8, plan.rows if decode_only == 0 else plan.num_decode,
                min(plan.max_seq_len, p.window) if p.window else plan.max_seq_len, query.device)
        return split

    def _launch_order(self, plan: _StepPlan) -> tuple[torch.Tensor | None, bool]:
        """The step's decode launch order (_row_order, sorted once per step) and whether the sort is launched now,
        right before this launch (then its CTAs must read the order after their wait)."""
        if plan.order is not _UNSORTED:
            return plan.order, False
        plan.order = self._row_order(plan)
        return plan.order, plan.order is not None

    def _launch_rows(self, p: AttnParams, plan: _StepPlan, query: torch.Tensor, decode_only: int) -> None:
        """The decode launch (row kernel or tensor-core decode kernel) of p, with its split plan and launch order."""
        num_heads, head_dim = query.shape[1:]
        p.P, p.part_size, p.head_groups = self._split_plan(p, plan, query, decode_only)
        order, sorted_now = self._launch_order(plan)
        if order is not None:
            p.row_order = order.data_ptr()
        p.decode_only = decode_only
        p.early_keys = 0 if sorted_now else int(self.early_keys)
        if p.P > 1:
            part_o = torch.empty((plan.rows, num_heads, p.P, head_dim), dtype=torch.float32, device=query.device)
            part_ml = torch.empty((plan.rows, num_heads, p.P, 2), dtype=torch.float32, device=query.device)
            p.part_o, p.part_ml = part_o.data_ptr(), part_ml.data_ptr()
            grid_rows = plan.rows if plan.rows <= GRID_ROWS else -(-plan.rows // GRID_ROWS) * GRID_ROWS
            p.part_count = self._counters(query.device, grid_rows * p.Hkv * p.head_groups).data_ptr()
        self._check(self._lib.pagednb_row_attention(self._dtype_codes[query.dtype], head_dim, ctypes.byref(p),
                                                    current_stream(query)), "row attention")

    def _row_plan(self, dtype: int, head_dim: int, group: int, num_kv_heads: int, variant: int, fp8: bool,
                  rows: int, range_max: int, device: torch.device) -> tuple[int, int, int]:
        sms = self._sm_count(device)
        P, size, groups = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        rc = self._lib.pagednb_row_plan(dtype, head_dim, group, num_kv_heads, max(rows, 1), max(range_max, 1), sms,
                                        variant, int(fp8), ctypes.byref(P), ctypes.byref(size), ctypes.byref(groups))
        self._check(rc, "row plan")
        forced = self.split_tokens if P.value == 1 else self.tail_tokens
        if forced and range_max > forced:
            return -(-range_max // forced), forced, groups.value
        return P.value, size.value, groups.value

    def _row_order(self, plan: _StepPlan) -> torch.Tensor | None:
        """The step's rows longest first (int64 indices into the rows) for the decode kernels' launch order (row
        kernel and tensor-core kernel alike), or None: rows in batch order. Only a step whose rows are one per
        sequence (no prefill chunk) is sorted."""
        if not self.longest_first or plan.rows != plan.num_seqs or not ORDER_MIN_ROWS <= plan.rows <= GRID_ROWS:
            return None
        return torch.argsort(plan.seq_lens, descending=True)

    def _counters(self, device: torch.device, n: int) -> torch.Tensor:
        """At least n split-K counters on this device (one per decode CTA column: row x kv head [x head
        group]). Zeroed once; every launch leaves them zero, so graph replays share them. A larger need
        allocates a larger array and keeps the old ones alive: captured graphs hold their addresses."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        arrays = self._part_counters.setdefault(idx, [])
        if not arrays or arrays[-1].numel() < n:
            if torch.cuda.is_current_stream_capturing():  # a captured memset would only zero them at replay
                raise RuntimeError(f"split-K counters for {n} decode CTAs are first needed inside a CUDA graph "
                                   "capture: run the captured step once before capturing it")
            arrays.append(torch.zeros(max(n, MIN_PART_COUNTERS), dtype=torch.int32, device=device))
        return arrays[-1]

    def _check(self, rc: int, what: str) -> None:
        check_status(self._lib, rc, what)
