"""Tensor parallelism (pagednb/distributed/): LLM(model, tensor_parallel_size=N).

On a CPU the ranks are processes joined by gloo, the same code path as NCCL on GPUs: greedy outputs at
tp=2 equal tp=1 token for token on the tiny model of every architecture (and on shapes that exercise
replicated kv heads, a vocabulary the ranks do not divide, tied embeddings and dummy weights); chunked
prefill, prefix caching, preemption, asynchronous scheduling and prompt logprobs keep working; close()
leaves no process; a killed worker ends every request with a clear error within seconds, in a script and
in a Jupyter kernel that survives it; a bad tensor_parallel_size is refused naming the field; the fp8 KV cache
and speculative decoding give tp=1's outputs at tp=2.

The GPU tests need two CUDA GPUs (the lead's `nvidia-h200-x2` machine); they skip with the count otherwise.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pagednb import LLM, SamplingParams
from pagednb.distributed import TensorParallelError
from test_architectures import ARCHITECTURES
from test_architectures import make_model as make_architecture_model
from test_moe import MODELS as MOE_MODELS
from tiny import EQUIVALENCE_PROMPTS, make_tiny_model

MAX_MODEL_LEN = 112
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# name -> (HF model_type, overrides); test_architectures' models have perturbed norm weights
CASES = {
    "llama": ("llama", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {}), "mistral": ("mistral", {}),
    **{name: ARCHITECTURES[name] for name in ARCHITECTURES},
    "qwen3_moe": MOE_MODELS["qwen3_moe"], "mixtral": MOE_MODELS["mixtral"],
    # one kv head for two ranks (replicated), a vocabulary of 387 rows (blocks of 194 and 193), tied LM head
    "llama_kv1_tied_odd_vocab": ("llama", dict(num_key_value_heads=1, vocab_size=387, tie_word_embeddings=True)),
    # OLMo 2's q/k norms span every head: gathered across ranks, the single kv head's twice
    "olmo2_kv1": ("olmo2", dict(num_key_value_heads=1)),
}
TWO_GPUS = torch.cuda.device_count() >= 2
TWO_GPUS_REASON = (f"needs 2 CUDA GPUs (tensor parallelism over NCCL); this machine has {torch.cuda.device_count()}"
                   f" (run on the nvidia-h200-x2 kind)")


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_rank():
    """The ranks share the CPU's cores: torch's intra-op threads spinning in rank 0 (OpenMP waits busily)
    would starve the worker it waits for in every collective (10x slower steps on two cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            if name in ARCHITECTURES:
                cache[name] = make_architecture_model(path, name)
            else:
                model_type, overrides = CASES[name]
                cache[name] = make_tiny_model(path, model_type, **overrides)
        return cache[name]

    return build


@pytest.fixture(scope="module")
def llama_tp1(checkpoint) -> list[list[int]]:
    """The tp=1 greedy outputs of the llama checkpoint, which several tests expect again at tp=2."""
    return greedy(checkpoint("llama"), 1)


def greedy(path: Path, tp: int, params: SamplingParams = GREEDY, **options) -> list[list[int]]:
    options = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN) | options
    with LLM(str(path), tensor_parallel_size=tp, **options) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(EQUIVALENCE_PROMPTS, params, use_tqdm=False)]


def child_pids() -> list[str]:
    """This process's live children, each as its command line (from /proc: a zombie is not alive)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == os.getpid() and state != "Z":
            children.append(f"{entry.name}: " + (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
    return children


# ---- the same outputs at tp=2 as at tp=1 -----------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_outputs_at_tp2_equal_tp1(checkpoint, llama_tp1, name):
    path = checkpoint(name)
    expected = llama_tp1 if name == "llama" else greedy(path, 1)
    assert greedy(path, 2) == expected
    assert len({tuple(t) for t in expected}) > 1  # the prompts' continuations differ: a real comparison


def test_dummy_weights_are_the_tp1_model_sliced(checkpoint):
    """load_format="dummy": each rank loads its slice of the very weights tp=1 draws (same seed)."""
    path = checkpoint("qwen3_moe")
    assert greedy(path, 2, load_format="dummy") == greedy(path, 1, load_format="dummy")


SCHEDULING = dict(num_kv_blocks=7, max_num_batched_tokens=16, async_scheduling=True)  # 7 blocks: one request


@pytest.fixture(scope="module")
def engines(checkpoint):
    """(tp=1, tp=2) engines of one model with a pool of one max-length request (preemptions), a 16-token
    budget (chunked prefill), prefix caching, and asynchronous scheduling (tokens sampled by the step in
    flight reach the workers on the device group)."""
    path = checkpoint("llama")
    options = dict(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, **SCHEDULING)
    one, two = LLM(str(path), **options), LLM(str(path), tensor_parallel_size=2, **options)
    yield one, two
    one.close()
    two.close()


def test_chunked_prefill_prefix_caching_preemption_and_async_scheduling_at_tp2(engines):
    one, two = engines
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for _ in range(2):  # the second pass hits the prefix cache
        expected = [o.outputs[0].token_ids for o in one.generate(EQUIVALENCE_PROMPTS, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in two.generate(EQUIVALENCE_PROMPTS, params, use_tqdm=False)]
        assert got == expected
    stats = two.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    two.engine.check_integrity()


def test_the_fp8_cache_and_speculative_decoding_at_tp2_give_tp1s_outputs(tmp_path):
    """The other engine options ride on the same step inputs: each rank keeps an fp8 pool of its kv heads, and
    a drafted step's verify rows reach the workers as ordinary decode rows. (A small-init model falls into
    loops, so its drafts are accepted: test_spec_decode's choice.)"""
    path = make_tiny_model(tmp_path / "looping", "llama", initializer_range=0.02)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    runs = {}
    for tp, spec in ((1, None), (1, ngram), (2, ngram)):
        with LLM(str(path), tensor_parallel_size=tp, device="cpu", dtype="float32", num_kv_blocks=64,
                 max_model_len=MAX_MODEL_LEN, kv_cache_dtype="fp8", speculative_config=spec) as llm:
            outs = llm.generate(EQUIVALENCE_PROMPTS, params, use_tqdm=False)
            runs[tp, spec is not None] = [list(o.outputs[0].token_ids) for o in outs]
            accepted = llm.stats().get("spec_decode_num_accepted_tokens", 0)
    assert runs[2, True] == runs[1, True] == runs[1, False]
    assert accepted > 0, "no draft was accepted at tp=2: the test would prove nothing"


def test_logprobs_and_prompt_logprobs_at_tp2_match_tp1(engines):
    """Prompt logprobs run the LM head on rows besides the sampled ones: every rank must run it on them."""
    one, two = engines
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    prompts = EQUIVALENCE_PROMPTS[:3]
    for a, b in zip(one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for expected, got in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs,
                                 b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            assert got.keys() == expected.keys()
            for token, lp in expected.items():
                assert got[token].logprob == pytest.approx(lp.logprob, abs=1e-4)


def test_sleep_is_refused_with_a_clear_message_at_tp2(engines):
    with pytest.raises(NotImplementedError, match="tensor_parallel_size=2"):
        engines[1].sleep()


# ---- processes: close, a dead worker ------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["close", "del"])
def test_close_or_del_ends_the_workers(checkpoint, how):
    before = set(child_pids())
    llm = LLM(str(checkpoint("llama")), device="cpu", num_kv_blocks=16, max_model_len=MAX_MODEL_LEN,
              tensor_parallel_size=2)
    workers = {str(p.pid) for p in llm.engine.workers.processes}
    assert workers <= {child.split(":")[0] for child in child_pids()}
    if how == "close":
        llm.close()
        with pytest.raises(RuntimeError, match="closed"):
            llm.generate("x")
    else:
        del llm
    assert set(child_pids()) == before


def test_a_killed_worker_ends_every_request_with_a_clear_error_within_seconds(checkpoint):
    before = set(child_pids())  # a module-scoped engine's worker may be running
    llm = LLM(str(checkpoint("llama")), device="cpu", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN,
              tensor_parallel_size=2)
    worker = llm.engine.workers.processes[0]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def consume(stream):
        async for _ in stream:
            pass

    async def run() -> tuple[list, float]:
        streams = [llm.stream("Once upon a time", params), llm.stream("The dog", params)]
        await streams[0].__anext__()  # running
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        results = await asyncio.gather(*(consume(s) for s in streams), return_exceptions=True)
        return results, time.monotonic() - t0

    results, elapsed = asyncio.run(run())
    assert elapsed < 10
    for error in results:
        assert isinstance(error, TensorParallelError), error
        assert f"rank 1 (pid {worker.pid}) killed by SIGKILL" in str(error)
    with pytest.raises(RuntimeError, match="rank 1"):  # later calls say why the engine stopped
        llm.generate("x", use_tqdm=False)
    llm.close()
    assert worker.poll() is not None and set(child_pids()) == before


@pytest.mark.parametrize("where", ["python -c", "a script without a __main__ guard"])
def test_runs_from_python_c_and_from_a_script_without_a_main_guard(checkpoint, llama_tp1, tmp_path, where):
    path = checkpoint("llama")
    code = textwrap.dedent(f"""
        from pagednb import LLM, SamplingParams
        llm = LLM({str(path)!r}, device="cpu", num_kv_blocks=64, max_model_len={MAX_MODEL_LEN}, tensor_parallel_size=2)
        out = llm.generate({EQUIVALENCE_PROMPTS[:2]!r}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
        print([list(o.outputs[0].token_ids) for o in out])
        llm.close()
    """)
    script = tmp_path / "run.py"
    script.write_text(code)
    args = ["-c", code] if where == "python -c" else [str(script)]
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(llama_tp1[:2])


def test_in_a_jupyter_kernel_that_survives_a_killed_worker(checkpoint, llama_tp1):
    from jupyter_client.manager import start_new_kernel

    from kernel_support import run_cell
    path = checkpoint("llama")
    manager, client = start_new_kernel(kernel_name="python3", env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        out = run_cell(client, textwrap.dedent(f"""
            import os, signal
            from pagednb import LLM, SamplingParams
            llm = LLM({str(path)!r}, device="cpu", num_kv_blocks=64, max_model_len={MAX_MODEL_LEN},
                      tensor_parallel_size=2)
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            out = await llm.agenerate({EQUIVALENCE_PROMPTS[0]!r}, params)
            print("tokens", list(out.outputs[0].token_ids))
        """))
        assert f"tokens {llama_tp1[0]}" in out
        out = run_cell(client, textwrap.dedent("""
            os.kill(llm.engine.workers.processes[0].pid, signal.SIGKILL)
            try:
                llm.generate("The dog", SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
            except Exception as e:
                print("failed:", type(e).__name__, e)
            llm.close()
            print("alive", 6 * 7)
        """))
        assert "failed: TensorParallelError tensor-parallel worker rank 1" in out and "alive 42" in out
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


# ---- refused sizes ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, error, text", [
    (0, ValueError, "an int in [1, 64]"), (-1, ValueError, "an int in [1, 64]"), (65, ValueError, "an int in [1, 64]"),
    (1.5, TypeError, "an int"), (True, TypeError, "an int"), ("2", TypeError, "an int"),
])
def test_an_invalid_tensor_parallel_size_is_refused_naming_the_field(checkpoint, value, error, text):
    with pytest.raises(error, match=r"tensor_parallel_size must be .*" + text.replace("[", r"\[").replace("]", r"\]")):
        LLM(str(checkpoint("llama")), device="cpu", tensor_parallel_size=value)


@pytest.mark.parametrize("overrides, tp, field", [
    ({}, 3, "num_attention_heads \\(4\\)"),  # 4 heads over 3 ranks
    (dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16), 2, "num_key_value_heads \\(3\\)"),
    (dict(intermediate_size=126), 4, "intermediate_size \\(126\\)"),
])
def test_a_size_the_model_cannot_be_split_by_is_refused_before_any_worker_starts(tmp_path, overrides, tp, field):
    path = make_tiny_model(tmp_path / "m", "llama", **overrides)
    with pytest.raises(ValueError, match=f"tensor_parallel_size={tp} must .*{field}"):
        before = set(child_pids())
        LLM(str(path), device="cpu", tensor_parallel_size=tp)
    assert set(child_pids()) == before


def test_moe_experts_the_ranks_cannot_split_are_refused(tmp_path):
    model_type, overrides = MOE_MODELS["qwen3_moe"]
    path = make_tiny_model(tmp_path / "m", model_type, **(overrides | dict(moe_intermediate_size=30)))
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide the experts' intermediate size \\(30\\)"):
        LLM(str(path), device="cpu", tensor_parallel_size=4)


# ---- two GPUs (NCCL, CUDA graphs) -----------------------------------------------------------------------------
def gpu_greedy(path: Path, tp: int, dtype: str, **options) -> list:
    options = dict(device="cuda", dtype=dtype, max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=0.3) | options
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    with LLM(str(path), tensor_parallel_size=tp, **options) as llm:
        assert llm.engine.uses_cuda_graphs == (not options.get("enforce_eager", False))
        return [o.outputs[0] for o in llm.generate(EQUIVALENCE_PROMPTS, params, use_tqdm=False)]


@pytest.mark.skipif(not TWO_GPUS, reason=TWO_GPUS_REASON)
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "qwen3_moe", "llama_kv1_tied_odd_vocab"])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_gpu_float32_tp2_equals_tp1(checkpoint, name, enforce_eager):
    path = checkpoint(name)
    expected = gpu_greedy(path, 1, "float32", enforce_eager=enforce_eager)
    got = gpu_greedy(path, 2, "float32", enforce_eager=enforce_eager)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


@pytest.mark.skipif(not TWO_GPUS, reason=TWO_GPUS_REASON)
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "qwen3_moe"])
def test_gpu_bfloat16_tp2_matches_tp1_up_to_near_ties(checkpoint, name):
    """bf16 sums in another order (partial sums, then the all-reduce): a continuation may part from tp=1's
    only where tp=1's two best tokens were within 0.1 nats of each other."""
    path = checkpoint(name)
    expected, got = gpu_greedy(path, 1, "bfloat16"), gpu_greedy(path, 2, "bfloat16")
    for a, b in zip(expected, got):
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if same is not None:
            top2 = sorted((lp.logprob for lp in a.logprobs[same].values()), reverse=True)[:2]
            assert top2[0] - top2[1] < 0.1, (a.token_ids, b.token_ids, same)


@pytest.mark.skipif(not TWO_GPUS, reason=TWO_GPUS_REASON)
def test_gpu_killed_worker_fails_requests_within_seconds_and_close_frees_both_gpus(checkpoint):
    before = set(child_pids())
    free_before = torch.cuda.mem_get_info(1)[0]
    llm = LLM(str(checkpoint("llama")), device="cuda", max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=0.3,
              tensor_parallel_size=2)
    assert torch.cuda.mem_get_info(1)[0] < free_before - 2**30  # the worker's KV pool lives on cuda:1
    worker = llm.engine.workers.processes[0]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm.generate(EQUIVALENCE_PROMPTS, params, use_tqdm=False)
    t0 = time.monotonic()
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(TensorParallelError, match="rank 1 .* killed by SIGKILL"):
        llm.generate(EQUIVALENCE_PROMPTS * 8, params, use_tqdm=False)
    assert time.monotonic() - t0 < 10
    llm.close()
    assert worker.poll() is not None and set(child_pids()) == before
    assert torch.cuda.mem_get_info(1)[0] > free_before - 2**28


@pytest.mark.skipif(not 0 < torch.cuda.device_count() < 16, reason="needs 1 to 15 CUDA GPUs")
def test_more_ranks_than_gpus_are_refused(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama", num_attention_heads=16, num_key_value_heads=16, head_dim=16)
    with pytest.raises(ValueError, match=f"tensor_parallel_size=16 needs 16 GPUs from cuda.*, but this machine has "
                                         f"{torch.cuda.device_count()}"):
        LLM(str(path), device="cuda", tensor_parallel_size=16)
