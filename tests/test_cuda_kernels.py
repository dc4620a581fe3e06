"""pagednb's CUDA kernels against the pure-torch reference (run on the H200; skipped without a GPU).

Every case draws fresh random inputs into a cache of shuffled, non-contiguous blocks; unused block-table
entries and blocks that a sliding window has released point at NaN-filled blocks in the kernels' copy
of the cache (so reading one shows up as NaN), the allocator is poisoned with NaN before each run (so
an unwritten output shows up), and the output is compared with the reference computed in float32:
relative error ||out - ref|| / ||ref|| under 1e-2 for bf16/fp16 inputs (1e-4 for float32), per row
under 3e-2. Then whole-engine greedy outputs with the CUDA backend equal HF transformers' (float32).
"""
from __future__ import annotations

import random

import pytest
import torch

from gpu_support import cuda_backend, gpu

from pagednb.attention import AttentionMetadata, TorchReferenceBackend
from pagednb.attention.selector import select_attention_backend



# ---- runs everywhere: the selector's contract ------------------------------------------------------
def test_cpu_selection_is_the_reference_and_forcing_cuda_on_cpu_raises():
    assert select_attention_backend(torch.device("cpu"), "auto").name == "torch_ref"
    assert select_attention_backend(torch.device("cpu"), "torch_ref").name == "torch_ref"
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        select_attention_backend(torch.device("cpu"), "cuda")
    with pytest.raises(ValueError):
        select_attention_backend(torch.device("cpu"), "flash")


# ---- GPU cases ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 1, 0], ids=["rows-tensor-core", "rows-pipelined", "rows-direct"])
def backend(request):
    """The backend with each row-kernel variant (2, as the default 4 over a 16-bit cache: tensor cores for
    16-bit rows with 4-16 query heads per kv head at head_dim 64, else as 1; 1: cp.async ring; 0: direct loads)."""
    return cuda_backend(request.param)


class Case:
    """A random step: `seq_lens[i]` tokens in sequence i after the step, the last `query_lens[i]` new."""

    def __init__(self, seq_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, window=None,
                 pad_rows=0, fused_qkv=False, seed=0, softcap=None):
        dev = torch.device("cuda")
        gen = torch.Generator(device=dev).manual_seed(seed)
        rng = random.Random(seed)
        self.window, self.dtype, self.softcap = window, dtype, softcap
        bs = block_size
        nblk = [-(-n // bs) for n in seq_lens]
        spare = 3
        total = sum(nblk) + spare
        perm = torch.randperm(total, generator=gen, device=dev).tolist()
        used, poison = perm[:sum(nblk)], perm[sum(nblk):]
        width = max(nblk) + 2
        tables = [[rng.choice(poison) for _ in range(width)] for _ in seq_lens]
        first = 0
        released = []
        for i, n in enumerate(seq_lens):
            tables[i][:nblk[i]] = used[first:first + nblk[i]]
            first += nblk[i]
            if window is not None:  # blocks wholly behind every query's window: released, poisoned
                lowest = max(0, n - query_lens[i] - window + 1)
                released += [tables[i][b] for b in range(nblk[i]) if (b + 1) * bs <= lowest]
        self.block_tables = torch.tensor(tables, dtype=torch.int32, device=dev)
        self.cache = torch.randn(2, total, bs, kv_heads, head_dim, generator=gen, device=dev).to(dtype)
        self.poisoned = sorted(set(poison) | set(released))
        self.kernel_cache = self.cache.clone()
        self.kernel_cache[:, self.poisoned] = float("nan")

        rows = sum(query_lens)
        n = rows + pad_rows
        width_qkv = (heads + 2 * kv_heads) * head_dim
        if fused_qkv:  # views into one projection output: strided rows, as the model produces them
            qkv = torch.randn(n, width_qkv, generator=gen, device=dev).to(dtype)
            self.q = qkv[:, :heads * head_dim].view(n, heads, head_dim)
            self.k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
            self.v = qkv[:, (heads + kv_heads) * head_dim:].view(n, kv_heads, head_dim)
        else:
            self.q = torch.randn(n, heads, head_dim, generator=gen, device=dev).to(dtype)
            self.k = torch.randn(n, kv_heads, head_dim, generator=gen, device=dev).to(dtype)
            self.v = torch.randn(n, kv_heads, head_dim, generator=gen, device=dev).to(dtype)
        slots = []
        for i, (sl, ql) in enumerate(zip(seq_lens, query_lens)):
            for p in range(sl - ql, sl):
                slots.append(tables[i][p // bs] * bs + p % bs)
        slots += [-1] * pad_rows
        starts = [0]
        for ql in query_lens:
            starts.append(starts[-1] + ql)
        self.rows = rows
        self.md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=self.block_tables, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens))
        self.scale = head_dim ** -0.5

    def reference(self) -> torch.Tensor:
        ref = TorchReferenceBackend()
        cache = self.cache.float()
        ref.write_kv(self.k.float(), self.v.float(), cache, self.md.slot_mapping)
        return ref.attend(self.q.float(), cache, self.md, self.scale, self.window, self.softcap)

    def expected_cache(self) -> torch.Tensor:
        cache = self.cache.clone()
        TorchReferenceBackend().write_kv(self.k, self.v, cache, self.md.slot_mapping)
        return cache


def _poison_allocator(nbytes: int) -> None:
    """Leaves NaN in the caching allocator's free blocks (the output's exact size freed last, so the
    backend's torch.empty of its output gets it back): an unwritten output element reads as NaN."""
    for size in (4 * nbytes, nbytes):
        x = torch.full((max(size // 4, 1),), float("nan"), device="cuda")
        del x


def check(backend, case: Case) -> None:
    backend.write_kv(case.k, case.v, case.kernel_cache, case.md.slot_mapping)
    expected = case.expected_cache()
    keep = torch.ones(case.cache.shape[1], dtype=torch.bool, device="cuda")
    keep[case.poisoned] = False
    assert torch.equal(case.kernel_cache[:, keep], expected[:, keep]), "cache write differs from the reference"

    _poison_allocator(case.q.numel() * case.q.element_size())
    out = backend.attend(case.q, case.kernel_cache, case.md, case.scale, case.window, case.softcap)
    torch.cuda.synchronize()
    ref = case.reference()
    assert out.dtype == case.dtype and out.shape == case.q.shape
    assert not out.isnan().any(), f"{int(out.isnan().any(-1).any(-1).sum())} rows hold NaN"
    if case.rows < out.shape[0]:
        assert out[case.rows:].eq(0).all(), "padding rows must be zero"
    o, r = out[:case.rows].float(), ref[:case.rows].float()
    tol = 1e-4 if case.dtype == torch.float32 else 1e-2
    rel = ((o - r).norm() / r.norm()).item()
    per_row = ((o - r).flatten(1).norm(dim=1) / r.flatten(1).norm(dim=1).clamp_min(1e-6)).max().item()
    assert rel < tol, f"relative error {rel:.2e}"
    assert per_row < 3 * tol, f"worst row relative error {per_row:.2e}"


def _lens(rng: random.Random, batch: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(batch)]


# (batch, max_len, heads, kv_heads, head_dim, block_size, dtype, window)
DECODE = [
    (64, 4096, 32, 8, 128, 16, torch.bfloat16, None),
    (256, 1024, 16, 8, 128, 32, torch.bfloat16, None),
    (1, 32768, 32, 8, 128, 16, torch.bfloat16, None),
    (3, 32768, 8, 1, 64, 32, torch.float16, None),
    (5, 3000, 8, 2, 256, 16, torch.bfloat16, None),
    (9, 2000, 10, 2, 128, 16, torch.float16, None),
    (4, 1500, 32, 2, 64, 32, torch.bfloat16, None),
    (32, 5000, 32, 8, 128, 16, torch.bfloat16, 1024),
    (16, 2000, 16, 4, 128, 16, torch.float32, None),
    (16, 2000, 16, 4, 256, 32, torch.float32, 100),
    (12, 700, 4, 2, 16, 16, torch.bfloat16, None),
    (12, 700, 8, 4, 32, 16, torch.float32, 24),
    (7, 300, 6, 2, 32, 32, torch.float16, None),
    (256, 1100, 32, 8, 64, 16, torch.bfloat16, None),  # the Llama-3.2-1B shape
    (6, 900, 24, 4, 64, 32, torch.float16, 200),       # 6 heads per kv head, sliding window
    (2, 4000, 16, 1, 128, 16, torch.bfloat16, None),   # 16 heads per kv head, split-K
]


@gpu
@pytest.mark.parametrize("case_id", range(len(DECODE)))
def test_decode_matches_reference(backend, case_id):
    batch, max_len, h, hkv, d, bs, dtype, window = DECODE[case_id]
    rng = random.Random(100 + case_id)
    seq_lens = _lens(rng, batch, 1, max_len)
    seq_lens[0] = max_len  # the longest length always present
    if batch > 1:
        seq_lens[1] = 1
    check(backend, Case(seq_lens, [1] * batch, h, hkv, d, bs, dtype, window, seed=case_id))


# (context lens, chunk lens, heads, kv_heads, head_dim, block_size, dtype, window)
PREFILL = [
    ([2048], [2048], 32, 8, 128, 16, torch.bfloat16, None),
    ([700, 0, 33, 5000], [300, 129, 1000, 64], 16, 8, 128, 32, torch.float16, None),
    ([300, 17], [200, 77], 8, 4, 256, 16, torch.bfloat16, None),
    ([0, 1000], [77, 513], 32, 4, 64, 16, torch.bfloat16, None),
    ([2000, 10], [1000, 300], 16, 8, 128, 16, torch.bfloat16, 256),
    ([0, 40, 3], [37, 20, 130], 4, 2, 16, 16, torch.bfloat16, None),
    ([5, 64], [60, 100], 8, 4, 32, 32, torch.float16, 24),
    ([100, 0], [50, 200], 8, 2, 64, 16, torch.float32, None),
    ([100, 0], [50, 200], 8, 2, 64, 32, torch.float32, 64),
]


@gpu
@pytest.mark.parametrize("case_id", range(len(PREFILL)))
def test_prefill_chunks_match_reference(backend, case_id):
    ctx, chunks, h, hkv, d, bs, dtype, window = PREFILL[case_id]
    seq_lens = [c + q for c, q in zip(ctx, chunks)]
    check(backend, Case(seq_lens, chunks, h, hkv, d, bs, dtype, window, seed=1000 + case_id))


# Gemma 2's attention soft-capping, in every kernel: (seq_lens, query_lens, heads, kv_heads, head_dim,
# block_size, dtype, window). A scale of 0.5 makes raw scores large, so the cap of 3 changes the softmax a lot.
SOFTCAP = [
    ([3000, 1, 700], [1, 1, 1], 8, 4, 256, 16, torch.bfloat16, None),  # row kernel, Gemma 2's head_dim
    ([2000, 900], [1, 1], 32, 4, 64, 16, torch.bfloat16, None),  # tensor-core decode (8 heads per kv head)
    ([1500, 40], [1, 1], 8, 2, 128, 16, torch.float32, 100),  # float32 rows, sliding window
    ([700, 333, 2], [300, 333, 1], 8, 4, 256, 16, torch.bfloat16, 128),  # prefill chunks and a decode row
    ([500, 64], [200, 64], 16, 8, 128, 32, torch.float16, None),
    # the tiny Gemma 2 of test_architectures: a window of 8 inside blocks of 16, a 16-token chunk after context,
    # a whole prompt and decode rows, on the float32 rows and on the bf16 prefill and decode kernels
    ([72, 64, 9], [16, 64, 1], 4, 2, 16, 16, torch.float32, 8),
    ([72, 40, 100], [72, 16, 1], 4, 2, 16, 16, torch.bfloat16, 8),
]


@gpu
@pytest.mark.parametrize("case_id", range(len(SOFTCAP)))
def test_attention_softcap_matches_reference(backend, case_id):
    seq_lens, query_lens, h, hkv, d, bs, dtype, window = SOFTCAP[case_id]
    case = Case(seq_lens, query_lens, h, hkv, d, bs, dtype, window, seed=3000 + case_id, softcap=3.0)
    case.scale = 0.5
    check(backend, case)
    uncapped = TorchReferenceBackend().attend(case.q.float(), case.expected_cache().float(), case.md, case.scale,
                                              case.window)
    capped = case.reference()
    assert ((capped - uncapped).norm() / capped.norm()).item() > 0.1  # the cap does change the result


MIXED = [
    (torch.bfloat16, 128, 16, None, False),
    (torch.float16, 64, 32, 200, True),
    (torch.float32, 128, 16, None, True),
    (torch.float32, 16, 16, 24, False),
    (torch.bfloat16, 32, 16, 24, True),
]


@gpu
@pytest.mark.parametrize("case_id", range(len(MIXED)))
def test_mixed_prefill_and_decode_batch(backend, case_id):
    dtype, d, bs, window, fused = MIXED[case_id]
    rng = random.Random(2000 + case_id)
    seq_lens, query_lens = [], []
    for _ in range(40):  # decode rows
        n = rng.randint(1, 3000)
        seq_lens.append(n)
        query_lens.append(1)
    for ctx, q in [(0, 333), (1500, 64), (17, 2), (4000, 700)]:  # chunks, a first prompt, a 2-token chunk
        seq_lens.append(ctx + q)
        query_lens.append(q)
    order = list(range(len(seq_lens)))
    rng.shuffle(order)
    seq_lens = [seq_lens[i] for i in order]
    query_lens = [query_lens[i] for i in order]
    check(backend, Case(seq_lens, query_lens, 16, 4, d, bs, dtype, window, pad_rows=5, fused_qkv=fused,
                        seed=2000 + case_id))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_cache_write_skips_slot_minus_one(backend, dtype):
    gen = torch.Generator(device="cuda").manual_seed(7)
    cache = torch.randn(2, 50, 16, 4, 64, generator=gen, device="cuda").to(dtype)
    n = 300
    key = torch.randn(n, 4, 64, generator=gen, device="cuda").to(dtype)
    value = torch.randn(n, 4, 64, generator=gen, device="cuda").to(dtype)
    slots = torch.randperm(50 * 16, generator=gen, device="cuda")[:n]
    slots[torch.rand(n, generator=gen, device="cuda") < 0.3] = -1
    expected = cache.clone()
    TorchReferenceBackend().write_kv(key, value, expected, slots)
    backend.write_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)


@gpu
def test_auto_selects_the_cuda_backend_on_a_gpu():
    assert select_attention_backend(torch.device("cuda"), "auto").name == "cuda"
    assert select_attention_backend(torch.device("cuda"), "torch_ref").name == "torch_ref"


# ---- the whole engine on the GPU with the CUDA backend vs HF transformers ------------------------------
PROMPTS = ["Once upon a time there was a cat", "The dog", "Paged attention stores the key value cache " * 3,
           "Paged attention stores the key value cache " * 3 + "in blocks"]  # the last two share a prefix


@gpu
@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {}),
    ("llama", {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1}),   # head_dim 64, G 4
    ("mistral", {"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}),  # head_dim 128
])
def test_engine_greedy_matches_hf_with_cuda_backend(tiny_model_dir, arch, overrides):
    from tiny import hf_greedy

    from pagednb import LLM, SamplingParams

    path = tiny_model_dir(arch, **overrides)
    refs = hf_greedy(path, PROMPTS, 24, device="cuda")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
             attention_backend="cuda") as llm:
        assert llm.engine.attention_backend.name == "cuda"
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        again = llm.generate(PROMPTS[2:], greedy, use_tqdm=False)  # prefix-cache hits where allowed
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert [o.outputs[0].token_ids for o in again] == refs[2:]
    assert [o.outputs[0].token_ids for o in again] == refs[2:]


@gpu
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["2-heads-per-kv-head", "4-heads-per-kv-head"])
def test_engine_bf16_cuda_backend_agrees_with_reference_backend(tiny_model_dir, kv_heads):
    """bf16 through the tensor-core prefill path (and, with 4 query heads per kv head at head_dim 64, the
    tensor-core decode path): the first greedy tokens agree with the reference backend."""
    from pagednb import LLM, SamplingParams

    path = tiny_model_dir("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=kv_heads)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = {}
    for name in ("cuda", "torch_ref"):
        with LLM(str(path), dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=64,
                 attention_backend=name) as llm:
            results[name] = [o.outputs[0].token_ids[:2] for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    agree = sum(a == b for a, b in zip(results["cuda"], results["torch_ref"]))
    assert agree >= len(PROMPTS) - 1, results  # bf16 rounding may flip one near-tie
