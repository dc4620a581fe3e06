"""Temperature sampling in one kernel (pagednb/engine/sampling_kernel.py, kernels_cuda/sampling.cu).

On CPU (always run): the torch reference is the sampler's own path, token for token, with the same
uniforms; the sampler hands plain-temperature rows (and only those) to the kernel with the uniforms it
drew; the kernel declines CPU tensors and layouts it does not take; and the way the GPU tests place
their uniforms away from CDF boundaries makes the reference pick the intended token.

On a GPU (the H200 device; skipped elsewhere or when the kernels do not load): the kernel's token is
the reference's whenever the target lies well inside a token's interval of the CDF (the two differ in
float rounding only), for V = 37, 1000, 151936 and strided rows; 200k draws follow softmax(l / T);
-inf logits are never chosen, u = 0 and u -> 1 pick the last and first tokens of nonzero weight,
rows with NaN, +inf or only -inf logits (or an overflow of l / T) are flagged with -1 and change
nothing for the other rows; a row's token does not depend on its batch; a CUDA graph replays the
eager result; and the sampler draws the same tokens for seeded rows with or without the kernel. Up to 16
rows of a large vocabulary run on the sliced kernel (a cluster of CTAs a row): the same draws (a row alone,
on the cluster, against the same row in a batch of 24 on one CTA), and the cases above at 1-16 rows.

The greedy kernel (`sampling_kernel.greedy`, the sampler's greedy rows): on CPU it declines and the
sampler's torch path runs; on a GPU its token is torch's `max` index (the first of tied maxima) for
float32, bf16 and fp16 rows, dense, strided and unaligned, and -1 exactly where torch's max is not finite
(NaN, +inf, all -inf), row by row; it replays in a CUDA graph. A few rows of a large vocabulary (a batch-1
step) go through the sliced kernel (a cluster of CTAs per row, merged in slice order): ties on both sides of
the slice boundaries, a max in the last slice, a bad logit in any one slice, at 1-17 rows (both kernels), in
a CUDA graph at batch 1.
"""
from __future__ import annotations

import pytest
import torch

from gpu_support import built_kernels, captured, gpu

from pagednb.engine import sampler as sampler_module
from pagednb.engine import sampling_kernel
from pagednb.engine.sampler import Sampler, SamplingMetadata, _uniforms
from pagednb.engine.sampling_kernel import SamplingKernel, sample_with_temperature, sample_with_temperature_reference
from pagednb.sampling_params import SamplingParams

TEMPERATURES = [0.2, 0.6, 1.0, 2.0]
U_BELOW_ONE = 1.0 - 2.0 ** -24  # the largest float32 below 1 (torch.rand's largest value)


# ---- inputs --------------------------------------------------------------------------------------------
def metadata(params, generator, generators=None, vocab=37, device="cpu"):
    n = len(params)
    return SamplingMetadata.build(params, generators or [None] * n, [[] for _ in range(n)],
                                  [[] for _ in range(n)], vocab, torch.device(device), generator=generator)


def uniforms_inside(logits: torch.Tensor, temperature: torch.Tensor, gen: torch.Generator
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(u [n] float32, the token each u selects): per row a token of probability at least half the
    row's largest, and u putting the target in the middle of that token's interval of the float64
    CDF, a margin of a quarter of the top probability or more, far beyond float32 rounding."""
    p = torch.softmax(logits.double() / temperature.double().reshape(-1, 1), dim=-1)
    cdf = p.cumsum(-1)
    u, tokens = [], []
    for i in range(p.shape[0]):
        candidates = (p[i] >= p[i].max() / 2).nonzero().flatten()
        j = candidates[torch.randint(len(candidates), (1,), generator=gen)].item()
        mid = cdf[i, j].item() - p[i, j].item() / 2
        u.append(1.0 - mid)
    u = torch.tensor(u, dtype=torch.float32)
    tokens = torch.searchsorted(cdf, (1.0 - u.double()).reshape(-1, 1)).flatten()  # after rounding u
    return u, tokens


def row_logits(n: int, vocab: int, gen: torch.Generator, layout: str = "dense", device="cpu") -> torch.Tensor:
    """randn * 3 logits [n, vocab]: dense, or a view whose rows lie `vocab + pad` apart from `offset`
    elements in ("aligned": rows 16-byte aligned when vocab % 4 == 0, the kernel's float4 path; "odd":
    never aligned, its 4-byte path)."""
    if layout == "dense":
        return (torch.randn(n, vocab, generator=gen) * 3).to(device)
    offset, pad = (4, 8) if layout == "aligned" else (1, 3)
    return (torch.randn(n, vocab + pad, generator=gen) * 3).to(device)[:, offset:offset + vocab]


# ---- CPU ---------------------------------------------------------------------------------------------
def test_reference_is_the_samplers_path():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 37, generator=gen) * 3
    logits[2, :30] = float("-inf")
    params = [SamplingParams(temperature=TEMPERATURES[i % 4]) for i in range(6)]
    params += [SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=1.3, seed=8)]
    for step in range(20):

        def md():  # the same generators' states each time
            return metadata(params, torch.Generator().manual_seed(step),
                            [None] * 6 + [torch.Generator().manual_seed(100 * step + i) for i in (7, 8)])

        got = Sampler()(logits, md()).token_ids
        first = md()
        want = sample_with_temperature_reference(logits, first.temperature, _uniforms(first))
        assert torch.equal(got, want), f"step {step}"


def test_the_sampler_hands_plain_temperature_rows_to_the_kernel_with_its_uniforms(monkeypatch):
    calls = []

    def fake_kernel(logits, temperature, uniforms):
        calls.append(uniforms.clone())
        return torch.full((logits.shape[0],), 5, dtype=torch.int64)

    monkeypatch.setattr(sampler_module, "sample_with_temperature", fake_kernel)
    logits = torch.randn(4, 37, generator=torch.Generator().manual_seed(1))
    plain = [SamplingParams(temperature=0.7)] * 4
    out = Sampler()(logits, metadata(plain, torch.Generator().manual_seed(2))).token_ids
    assert out.tolist() == [5] * 4 and len(calls) == 1
    assert torch.equal(calls[0], torch.rand(4, 1, generator=torch.Generator().manual_seed(2)))
    for filtered in (SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.7, top_p=0.9),
                     SamplingParams(temperature=0.7, min_p=0.1)):
        Sampler()(logits, metadata([filtered] * 4, torch.Generator().manual_seed(2)))
        assert len(calls) == 1, f"{filtered} went to the kernel"


def test_16_bit_logits_reach_the_kernel_as_they_are_and_everything_else_as_float32(monkeypatch):
    seen = []

    def fake_kernel(logits, temperature, uniforms):
        seen.append(logits.dtype)
        return torch.zeros(logits.shape[0], dtype=torch.int64)

    monkeypatch.setattr(sampler_module, "sample_with_temperature", fake_kernel)
    logits = (torch.randn(4, 37, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    Sampler()(logits, metadata([SamplingParams(temperature=0.7)] * 4, torch.Generator().manual_seed(1)))
    assert seen == [torch.bfloat16]  # no float32 copy of the logits for plain temperature rows
    Sampler()(logits, metadata([SamplingParams(temperature=0.7, logprobs=2)] * 4, torch.Generator().manual_seed(1)))
    penalised = SamplingMetadata.build([SamplingParams(temperature=0.7, repetition_penalty=1.2)] * 4, [None] * 4,
                                       [[1, 2, 3]] * 4, [[4]] * 4, 37, torch.device("cpu"),
                                       generator=torch.Generator().manual_seed(1))
    assert penalised.penalties is not None
    Sampler()(logits, penalised)
    assert seen[1:] == [torch.float32, torch.float32]


def test_the_sampler_draws_the_same_from_16_bit_logits_as_from_their_float32_copy():
    gen = torch.Generator().manual_seed(6)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=3),
              SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.1, top_p=0.8),
              SamplingParams(temperature=0.6, min_p=0.05), SamplingParams(temperature=0.9)]
    for dtype in (torch.bfloat16, torch.float16):
        logits = (torch.randn(6, 37, generator=gen) * 3).to(dtype)
        for step in range(10):
            def md():
                return metadata(params, torch.Generator().manual_seed(step),
                                [None, torch.Generator().manual_seed(step), None, None, None, None])
            assert torch.equal(Sampler()(logits, md()).token_ids, Sampler()(logits.float(), md()).token_ids)


def test_when_the_kernel_declines_the_torch_path_uses_the_same_uniforms(monkeypatch):
    monkeypatch.setattr(sampler_module, "sample_with_temperature", lambda *args: None)
    logits = torch.randn(4, 37, generator=torch.Generator().manual_seed(3)) * 2
    params = [SamplingParams(temperature=0.9)] * 4
    got = Sampler()(logits, metadata(params, torch.Generator().manual_seed(4))).token_ids
    u = torch.rand(4, 1, generator=torch.Generator().manual_seed(4))
    assert torch.equal(got, sample_with_temperature_reference(logits, torch.full((4, 1), 0.9), u))


def test_the_kernel_declines_cpu_tensors():
    logits = torch.randn(3, 37)
    assert sample_with_temperature(logits, torch.ones(3), torch.rand(3)) is None


MAX_VOCAB = 1 << 20  # the fake library's kMaxSampleVocab (kernels_cuda/launchers.h)


class _FakeLib:
    """Stands in for the CUDA library: its tables answer as kernels_cuda/bindings.cpp's do; the declines
    happen before any kernel call."""

    class _Fn:
        def __call__(self, *args):
            raise AssertionError("the kernel should have declined")

    def __init__(self) -> None:
        self.pagednb_sample_temperature = self._Fn()

    @staticmethod
    def pagednb_dtype_name(code: int) -> bytes | None:
        return (b"float32", b"float16", b"bfloat16", None)[code]

    @staticmethod
    def pagednb_max_sample_vocab() -> int:
        return MAX_VOCAB


@pytest.mark.parametrize("case", ["f64", "3d", "last_dim_strided", "too_wide", "temperature_f64",
                                  "temperature_len", "uniforms_as_a_row", "empty_vocab"])
def test_layouts_the_kernel_does_not_take(case):
    kernel = SamplingKernel(_FakeLib())
    logits, t, u = torch.randn(3, 40), torch.ones(3), torch.rand(3, 1)
    if case == "f64":
        logits = logits.double()
    elif case == "3d":
        logits = logits.view(3, 4, 10)
    elif case == "last_dim_strided":
        logits = logits[:, ::2]
    elif case == "too_wide":
        logits = torch.zeros(3, MAX_VOCAB + 1)
    elif case == "temperature_f64":
        t = t.double()
    elif case == "temperature_len":
        t = torch.ones(4)
    elif case == "uniforms_as_a_row":
        u = torch.rand(1, 3)
    elif case == "empty_vocab":
        logits = torch.randn(3, 0)
    assert kernel.sample(logits, t, u) is None


@pytest.mark.parametrize("vocab", [37, 151936])
def test_uniforms_inside_make_the_reference_pick_the_intended_token(vocab):
    """Checks the GPU tests' helper on the CPU: float32 rounding stays well inside the margin."""
    gen = torch.Generator().manual_seed(vocab)
    n = 16
    logits = row_logits(n, vocab, gen)
    temperature = torch.tensor([TEMPERATURES[i % 4] for i in range(n)])
    u, tokens = uniforms_inside(logits, temperature, gen)
    assert torch.equal(sample_with_temperature_reference(logits, temperature, u), tokens)


# ---- GPU -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kernel():
    return built_kernels(sampling_kernel.KERNEL.get)


def _draw(kernel, logits, temperature, u):
    got = kernel.sample(logits, temperature, u)
    assert got is not None, "the kernel declined these inputs"
    assert got.dtype == torch.int64 and got.shape == (logits.shape[0],)
    return got


@gpu
@pytest.mark.parametrize("vocab", [37, 1000, 151936])
@pytest.mark.parametrize("layout", ["dense", "aligned", "odd"])
@pytest.mark.parametrize("n", [64, 3], ids=["64-rows", "3-rows"])  # 3 rows of 151936: the sliced kernel
def test_kernel_picks_the_references_token_away_from_boundaries(kernel, vocab, layout, n):
    gen = torch.Generator().manual_seed(vocab + len(layout))
    logits_d = row_logits(n, vocab, gen, layout, device="cuda")
    assert logits_d.stride(1) == 1 and (layout == "dense") == logits_d.is_contiguous()
    temperature = torch.tensor([TEMPERATURES[i % 4] for i in range(n)])
    u, tokens = uniforms_inside(logits_d.cpu(), temperature, gen)
    t_d, u_d, tokens_d = temperature.cuda(), u.cuda(), tokens.cuda()
    assert torch.equal(sample_with_temperature_reference(logits_d, t_d, u_d), tokens_d)
    assert torch.equal(_draw(kernel, logits_d, t_d, u_d), tokens_d)
    # [n, 1] temperature and uniforms, as the sampler passes them
    assert torch.equal(_draw(kernel, logits_d, t_d.unsqueeze(1), u_d.unsqueeze(1)), tokens_d)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("vocab", [37, 1000, 151936])
@pytest.mark.parametrize("layout", ["dense", "aligned", "odd"])
def test_16_bit_logits_draw_what_their_float32_copy_draws(kernel, dtype, vocab, layout):
    """Read as they are, bf16/fp16 logits give the draw of their exact float32 copy in the same layout, for
    any u (the layout sets the chunking: 4 logits per load or one, so the same sums in the same order)."""
    gen = torch.Generator().manual_seed(vocab + len(layout) + 7)
    n = 64
    values = row_logits(n, vocab, gen, device="cuda").to(dtype)

    def laid_out(x: torch.Tensor) -> torch.Tensor:  # as row_logits lays rows out, for this dtype
        if layout == "dense":
            return x.contiguous()
        offset, pad = (4, 8) if layout == "aligned" else (1, 3)
        wide = torch.zeros(n, vocab + pad, dtype=x.dtype, device="cuda")
        wide[:, offset:offset + vocab] = x
        return wide[:, offset:offset + vocab]

    temperature = torch.tensor([TEMPERATURES[i % 4] for i in range(n)], device="cuda")
    u = torch.rand(n, generator=gen).cuda()
    got = _draw(kernel, laid_out(values), temperature, u)
    assert torch.equal(got, _draw(kernel, laid_out(values.float()), temperature, u))


@gpu
def test_draws_follow_softmax_of_logits_over_temperature(kernel):
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, float("-inf"), -1.0, -3.0, 0.25], device="cuda")
    n, temperature = 200_000, 0.7
    gen = torch.Generator(device="cuda").manual_seed(0)
    u = torch.rand(n, generator=gen, device="cuda")
    got = _draw(kernel, row.expand(n, -1), torch.full((n,), temperature, device="cuda"), u)  # row stride 0
    counts = torch.bincount(got, minlength=8).double().cpu()
    assert counts.sum().item() == n and counts[4].item() == 0  # the -inf token, never
    p = torch.softmax(row.double().cpu() / temperature, dim=-1)
    expected = n * p
    sigma = (n * p * (1 - p)).sqrt()
    finite = p > 0
    assert ((counts - expected).abs()[finite] <= 4.5 * sigma[finite]).all(), (counts, expected)
    chi2 = (((counts - expected) ** 2)[finite] / expected[finite]).sum().item()
    assert chi2 < 35.0, chi2  # 6 degrees of freedom: p ~ 4e-6


@gpu
@pytest.mark.parametrize("vocab", [1000, 151936])
def test_minus_inf_logits_are_never_chosen(kernel, vocab):
    gen = torch.Generator().manual_seed(vocab)
    n = 64
    logits = torch.randn(n, vocab, generator=gen) * 3
    logits[torch.rand(n, vocab, generator=gen) < 0.9] = float("-inf")
    logits[:, :5] = float("-inf")
    logits[:, -5:] = float("-inf")
    logits[0, 1:] = float("-inf")  # one finite token, in the first chunk, not at its start
    logits[0, 7] = 1.0
    u = torch.rand(n, generator=gen)
    u[:8], u[8:16] = 0.0, U_BELOW_ONE
    temperature = torch.tensor([TEMPERATURES[i % 4] for i in range(n)])
    got = _draw(kernel, logits.cuda(), temperature.cuda(), u.cuda()).cpu()
    assert torch.isfinite(logits.gather(1, got.unsqueeze(1))).all()
    assert got[0].item() == 7


@gpu
@pytest.mark.parametrize("vocab", [1000, 5000])
def test_u_zero_and_u_near_one_pick_the_last_and_first_weighted_tokens(kernel, vocab):
    """Logits in [-1, 1]: every finite weight moves the float32 running sums, so the extremes are
    exact: u = 0 (target = the total) the last finite token, u -> 1 the first."""
    gen = torch.Generator().manual_seed(11)
    n = 32
    logits = torch.rand(n, vocab, generator=gen) * 2 - 1
    logits[torch.rand(n, vocab, generator=gen) < 0.5] = float("-inf")
    logits[:, :3] = float("-inf")
    logits[:, -3:] = float("-inf")
    finite = torch.isfinite(logits)
    first = finite.int().argmax(-1)
    last = vocab - 1 - finite.flip(-1).int().argmax(-1)
    t = torch.full((n,), 1.0, device="cuda")
    for u, want in ((0.0, last), (U_BELOW_ONE, first)):
        got = _draw(kernel, logits.cuda(), t, torch.full((n,), u, device="cuda")).cpu()
        assert torch.equal(got, want), f"u={u}"


@gpu
@pytest.mark.parametrize("vocab", [1000, 151936])
def test_u_extremes_on_a_wide_row_stay_at_the_ends_of_the_cdf(kernel, vocab):
    gen = torch.Generator().manual_seed(12)
    n = 16
    logits = torch.randn(n, vocab, generator=gen) * 3
    temperature = torch.tensor([TEMPERATURES[i % 4] for i in range(n)])
    p = torch.softmax(logits.double() / temperature.double().reshape(-1, 1), dim=-1)
    cdf = p.cumsum(-1)
    for u in (0.0, U_BELOW_ONE):
        got = _draw(kernel, logits.cuda(), temperature.cuda(), torch.full((n,), u, device="cuda")).cpu()
        before = cdf.gather(1, got.unsqueeze(1)) - p.gather(1, got.unsqueeze(1))
        if u == 0.0:  # what follows the token is below float32 resolution of the total
            assert (1.0 - cdf.gather(1, got.unsqueeze(1)) < 1e-4).all()
        else:
            assert (before < 1e-4).all()
        assert (p.gather(1, got.unsqueeze(1)) > 0).all()


@gpu
def test_tiny_temperature_is_argmax(kernel):
    gen = torch.Generator().manual_seed(13)
    logits = (torch.randn(32, 151936, generator=gen) * 3).cuda()
    got = _draw(kernel, logits, torch.full((32,), 1e-3, device="cuda"), torch.full((32,), 0.5, device="cuda"))
    assert torch.equal(got, logits.argmax(-1))


def bad_rows(vocab: int, dtype=torch.float32) -> tuple[torch.Tensor, list[bool]]:
    """Logits [10, vocab] with rows that have no valid distribution and ordinary rows between them, and
    which rows are bad. Row 6 hides NaN in a whole chunk of the kernel's (1024 tokens with float4 loads,
    256 without), next to -inf: the chunk's max skips NaN, so only the explicit NaN check can catch it."""
    logits = torch.randn(10, vocab, generator=torch.Generator().manual_seed(14)).to(dtype)
    logits[0, 100] = float("nan")
    logits[1, :] = float("nan")
    logits[2, :] = float("-inf")
    logits[3, 4321 % vocab] = float("inf")
    logits[4, ::2] = float("nan")
    logits[5, 0] = float("inf")
    logits[5, 1] = float("nan")
    logits[6, :2048] = float("-inf")
    logits[6, 1024:2048:2] = float("nan")
    return logits, [True] * 7 + [False] * 3


def test_the_reference_flags_rows_without_a_valid_distribution():
    logits, bad = bad_rows(5000)
    u = torch.rand(10, generator=torch.Generator().manual_seed(1))
    got = sample_with_temperature_reference(logits, torch.ones(10), u)
    assert [t == -1 for t in got.tolist()] == bad
    good = torch.tensor(bad).logical_not()
    assert torch.equal(got[good], sample_with_temperature_reference(logits[good], torch.ones(3), u[good]))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# the float4 and the one-by-one load paths, on one CTA a row (5000, 5001) and on a cluster (151936, 151937)
@pytest.mark.parametrize("vocab", [5000, 5001, 151936, 151937])
def test_rows_without_a_valid_distribution_are_flagged_alone(kernel, dtype, vocab):
    logits, bad = bad_rows(vocab, dtype)
    u = torch.rand(10, generator=torch.Generator().manual_seed(2))
    got = _draw(kernel, logits.cuda(), torch.ones(10, device="cuda"), u.cuda()).cpu()
    assert [t == -1 for t in got.tolist()] == bad, got
    good = torch.tensor(bad).logical_not()
    assert ((got[good] >= 0) & (got[good] < vocab)).all()
    alone = _draw(kernel, logits[good].cuda(), torch.ones(3, device="cuda"), u[good].cuda()).cpu()
    assert torch.equal(got[good], alone)  # the bad rows changed nothing for the others


@gpu
def test_an_overflow_of_logits_over_temperature_is_flagged(kernel):
    logits = torch.randn(2, 1000, device="cuda")
    logits[0, 7] = 3e38  # finite, but / 1e-3 is +inf
    got = _draw(kernel, logits, torch.full((2,), 1e-3, device="cuda"), torch.full((2,), 0.5, device="cuda"))
    assert got.tolist() == [-1, logits[1].argmax().item()]


@gpu
def test_one_token_vocabulary(kernel):
    logits = torch.randn(4, 1, device="cuda")
    got = _draw(kernel, logits, torch.ones(4, device="cuda"), torch.rand(4, device="cuda"))
    assert got.tolist() == [0, 0, 0, 0]


@gpu
def test_a_rows_token_does_not_depend_on_its_batch(kernel):
    gen = torch.Generator().manual_seed(15)
    n, vocab = 24, 151936
    logits = (torch.randn(n, vocab, generator=gen) * 3).cuda()
    temperature = torch.tensor([TEMPERATURES[i % 4] for i in range(n)], device="cuda")
    u = torch.rand(n, generator=gen).cuda()
    batch = _draw(kernel, logits, temperature, u)
    alone = torch.cat([_draw(kernel, logits[i:i + 1], temperature[i:i + 1], u[i:i + 1]) for i in range(n)])
    assert torch.equal(batch, alone)


@gpu
@pytest.mark.parametrize("n", [48, 1])
def test_kernel_captures_in_a_cuda_graph_and_replays_on_new_inputs(kernel, n):
    gen = torch.Generator().manual_seed(16)
    vocab = 151936
    static_logits = torch.empty(n, vocab, device="cuda")
    static_t = torch.empty(n, 1, device="cuda")
    static_u = torch.empty(n, 1, device="cuda")

    def fill():
        static_logits.copy_(torch.randn(n, vocab, generator=gen) * 3)
        static_t.copy_(torch.rand(n, 1, generator=gen) * 1.8 + 0.2)
        static_u.copy_(torch.rand(n, 1, generator=gen))

    fill()
    graph, drawn = captured(lambda: _draw(kernel, static_logits, static_t, static_u))
    for _ in range(3):
        fill()
        eager = _draw(kernel, static_logits, static_t, static_u)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(drawn, eager)


@gpu
def test_sampler_draws_the_same_seeded_tokens_with_or_without_the_kernel(kernel, monkeypatch):
    gen = torch.Generator().manual_seed(17)
    n, vocab = 32, 1000
    logits = (torch.randn(n, vocab, generator=gen) * 2).cuda()
    params = [SamplingParams(temperature=TEMPERATURES[i % 4], seed=i) for i in range(n)]

    def run():
        gens = [torch.Generator(device="cuda").manual_seed(i) for i in range(n)]
        md = metadata(params, torch.Generator(device="cuda").manual_seed(0), gens, vocab, "cuda")
        return Sampler()(logits, md).token_ids

    with_kernel = run()
    monkeypatch.setattr(sampling_kernel.KERNEL, "enabled", lambda: None)
    without = run()
    # ties to a CDF boundary within float32 rounding are possible in principle; with these seeds, none
    assert torch.equal(with_kernel, without)


# ---- greedy ------------------------------------------------------------------------------------------------
def _torch_greedy(logits: torch.Tensor) -> torch.Tensor:
    """The sampler's torch path: max's index, -1 where the max is not finite."""
    top, ids = logits.max(-1)
    return torch.where(top.isfinite(), ids, -1)


def test_greedy_declines_cpu_tensors_and_the_sampler_runs_torch():
    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    assert sampling_kernel.greedy(logits) is None
    md = metadata([SamplingParams(temperature=0)] * 3, None, vocab=50)
    assert torch.equal(Sampler()(logits, md).token_ids, _torch_greedy(logits))


def _greedy(kernel, logits):
    got = kernel.greedy(logits)
    assert got is not None, "the kernel declined these inputs"
    assert got.dtype == torch.int64 and got.shape == (logits.shape[0],)
    return got


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("vocab", [1, 37, 1000, 151936])
@pytest.mark.parametrize("layout", ["dense", "aligned", "odd"])
def test_greedy_is_torchs_argmax_with_ties_to_the_first_index(kernel, dtype, vocab, layout):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=gen) * 3).to(device="cuda", dtype=dtype)
    if layout != "dense":  # rows vocab + 16 apart, from 8 elements in (16-byte vectors where vocab allows) or 3
        start = 8 if layout == "aligned" else 3
        base = torch.zeros(6, vocab + 16, dtype=dtype, device="cuda")
        logits = base[:, start:start + vocab].copy_(logits)
    if vocab > 1:  # ties: the row's max at several positions, the first must win
        top = logits.float().max().item() + 1
        logits[1, vocab // 3] = top
        logits[1, vocab - 1] = top
        logits[2, :] = 0.5
    assert torch.equal(_greedy(kernel, logits), _torch_greedy(logits))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [37, 151936])
def test_greedy_flags_rows_without_a_valid_distribution_alone(kernel, dtype, vocab):
    gen = torch.Generator().manual_seed(3)
    logits = row_logits(6, vocab, gen, device="cuda").to(dtype)
    logits[1, vocab - 1] = float("nan")
    logits[2, 0] = float("inf")
    logits[3] = float("-inf")
    logits[4, :] = float("-inf")
    logits[4, vocab // 2] = -1e30 if dtype == torch.float32 else -1e4  # one finite logit: a valid row
    got = _greedy(kernel, logits)
    assert got.tolist()[1:4] == [-1, -1, -1]
    assert torch.equal(got, _torch_greedy(logits))
    assert got[4].item() == vocab // 2


@gpu
def test_greedy_replays_in_a_cuda_graph(kernel):
    gen = torch.Generator().manual_seed(5)
    static_logits = torch.empty(4, 151936, device="cuda", dtype=torch.bfloat16)
    static_logits.copy_(torch.randn(4, 151936, generator=gen))
    graph, picked = captured(lambda: _greedy(kernel, static_logits))
    for _ in range(3):
        static_logits.copy_(torch.randn(4, 151936, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(picked, _torch_greedy(static_logits))


@gpu
def test_the_samplers_greedy_rows_go_through_the_kernel(kernel, monkeypatch):
    logits = torch.randn(3, 1000, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = sampling_kernel.greedy
    monkeypatch.setattr(sampler_module, "greedy", lambda x: calls.append(x) or real(x))
    md = metadata([SamplingParams(temperature=0)] * 3, None, vocab=1000, device="cuda")
    assert torch.equal(Sampler()(logits, md).token_ids, _torch_greedy(logits))
    assert len(calls) == 1 and calls[0].dtype == torch.bfloat16


GREEDY_SLICES = 8  # kernels_cuda/sampling.cu's kGreedySlices: a row's boundaries lie near multiples of vocab / 8


def _near_boundaries(vocab: int) -> list[int]:
    """Token ids on both sides of every slice boundary, whatever its rounding to a vector (<= 8 tokens)."""
    step = vocab // GREEDY_SLICES
    return sorted({b + d for s in range(1, GREEDY_SLICES) for b in [s * step] for d in (-9, -1, 0, 1, 8)})


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [16384, 20003, 151936])
@pytest.mark.parametrize("rows", [1, 2, 16, 17])
@pytest.mark.parametrize("layout", ["dense", "odd"])
def test_greedy_on_a_few_rows_of_a_large_vocabulary_keeps_the_first_max_across_slices(kernel, dtype, vocab, rows,
                                                                                        layout):
    gen = torch.Generator().manual_seed(vocab + rows)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    near = _near_boundaries(vocab)
    top = logits.float().max().item() + 1
    for r in range(rows):  # two tied maxima near slice boundaries, in one slice or two: the first must win
        logits[r, near[(5 * r) % len(near)]] = top
        logits[r, near[(5 * r + 3) % len(near)]] = top
    if rows > 1:
        logits[rows - 1] = 0.25  # all tied: token 0
        logits[0, :] = -1.0
        logits[0, vocab - 1] = 2.0  # the max in the last slice, alone
    if layout == "odd":  # rows 3 elements in and vocab + 16 apart: no 16-byte vectors
        base = torch.zeros(rows, vocab + 16, dtype=dtype)
        logits = base[:, 3:3 + vocab].copy_(logits)
    logits = logits.cuda()
    assert torch.equal(_greedy(kernel, logits), _torch_greedy(logits))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_flags_a_bad_logit_in_any_slice_of_a_sliced_row(kernel, dtype):
    vocab = 151936
    near = _near_boundaries(vocab)
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(12, vocab, generator=gen).to(dtype)
    logits[0, vocab - 1] = float("nan")  # the last token of the last slice
    logits[1, near[len(near) // 2]] = float("inf")  # a middle slice
    logits[2, 0] = float("nan")  # the first token of the first slice
    logits[3] = float("-inf")
    logits[4] = float("-inf")
    logits[4, vocab - 2] = -5.0  # one finite logit, in the last slice: a valid row
    logits[5, near[-1]] = float("-inf")  # -inf among finite ones: fine
    logits = logits.cuda()
    got = _greedy(kernel, logits)
    assert got.tolist()[:5] == [-1, -1, -1, -1, vocab - 2]
    assert torch.equal(got, _torch_greedy(logits))


@gpu
def test_greedy_of_one_row_replays_in_a_cuda_graph(kernel):
    gen = torch.Generator().manual_seed(6)
    static_logits = torch.empty(1, 151936, device="cuda", dtype=torch.bfloat16)
    static_logits.copy_(torch.randn(1, 151936, generator=gen))
    graph, picked = captured(lambda: _greedy(kernel, static_logits))
    for position in (0, 151935, 18991, 18992, 75968):  # first, last, and around slice boundaries
        static_logits.copy_(torch.randn(1, 151936, generator=gen))
        static_logits[0, position] = 10.0
        graph.replay()
        torch.cuda.synchronize()
        assert picked.item() == position
        assert torch.equal(picked, _torch_greedy(static_logits))
