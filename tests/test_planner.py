"""The memory planner's numbers against a hand computation, and against what the engine really does."""
import pytest

from pagednb import LLM, SamplingParams
from pagednb.planner import plan

BS = 8
# The tiny llama (tests/tiny.py): 2 layers, 2 KV heads of 64 / 4 = 16 dims, float32 on a CPU:
# K and V of one token = 2 * 2 layers * 2 heads * 16 dims * 4 bytes.
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


@pytest.fixture
def make_llm(tiny_model_dir):
    made = []

    def make(**options):
        options = {"max_model_len": 128, "block_size": BS, **options}
        made.append(LLM(str(tiny_model_dir("llama")), **options))
        return made[-1]

    yield make
    for llm in made:
        llm.close()


def test_users_that_fit_with_and_without_a_shared_prefix(make_llm):
    llm = make_llm(num_kv_blocks=64)
    p = plan(llm, prompt_tokens=30, output_tokens=10, users=20, shared_prefix_tokens=16)
    assert p.kv_bytes_per_token == BYTES_PER_TOKEN and p.num_blocks == 64
    assert p.blocks_per_user == 5  # ceil(40 / 8)
    assert p.users_fit_unshared == 64 // 5
    assert p.shared_blocks == 2 and p.users_fit_shared == (64 - 2) // (5 - 2)
    assert p.fits and p.limit == "KV pool"
    assert p.bytes_needed == (2 + 20 * 3) * BS * BYTES_PER_TOKEN
    assert p.kv_cache_memory_needed == p.bytes_needed and p.gpu_memory_utilization_needed is None
    assert "20 users of 30 prompt + 10 output tokens: fit" in str(p)


def test_limits_other_than_the_pool(make_llm):
    llm = make_llm(num_kv_blocks=64, max_num_seqs=4)
    assert plan(llm, 30, 10).limit == "max_num_seqs" and plan(llm, 30, 10).users_fit == 4
    too_long = plan(llm, 120, 20)
    assert too_long.users_fit == 0 and too_long.limit == "max_model_len" and not too_long.fits
    assert plan(llm, 120, 20, max_model_len=256).users_fit == 64 // 18  # the what-if lifts it


def test_what_ifs_resize_the_pool_as_the_engine_would(make_llm):
    budget = 64 * BS * BYTES_PER_TOKEN
    llm = make_llm(kv_cache_memory=budget)
    assert plan(llm, 30, 10).num_blocks == llm.stats()["num_blocks"] == 64
    doubled = plan(llm, 30, 10, kv_cache_memory=2 * budget)
    assert doubled.num_blocks == make_llm(kv_cache_memory=2 * budget).stats()["num_blocks"] == 128
    assert doubled.users_fit == 128 // 5
    p = plan(llm, 30, 10)
    assert p.users_fit_by_dtype == {"float32": 64 // 5, "bfloat16": 128 // 5, "fp8": 256 // 5}  # halving bytes/token
    assert plan(llm, 30, 10, dtype="bfloat16").num_blocks == 128


def test_the_plan_holds_in_the_engine(make_llm):
    """users_fit users of that size run with no preemption; one more does not."""
    llm = make_llm(num_kv_blocks=64, enable_prefix_caching=False)
    p = plan(llm, prompt_tokens=30, output_tokens=10)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[10 + (i + j) % 300 for j in range(30)] for i in range(p.users_fit + 1)]
    llm.generate(prompts[:p.users_fit], params, use_tqdm=False)
    assert llm.stats()["preemptions"] == 0
    llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["preemptions"] > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_tokens=0, output_tokens=1), "prompt_tokens must be an int >= 1, got 0"),
    (dict(prompt_tokens=10, output_tokens=1, users=0), "users must be an int >= 1, got 0"),
    (dict(prompt_tokens=10, output_tokens=1, shared_prefix_tokens=11),
     r"shared_prefix_tokens must be an int in \[0, prompt_tokens=10\], got 11"),
    (dict(prompt_tokens=10, output_tokens=1, dtype="int3"), "dtype must be one of"),
])
def test_bad_input_names_the_field(make_llm, kwargs, match):
    llm = make_llm(num_kv_blocks=64)
    with pytest.raises(ValueError, match=match):
        plan(llm, **kwargs)


def test_the_sliders_show_the_plain_functions_numbers(make_llm):
    from pagednb.notebook import planner_view

    llm = make_llm(num_kv_blocks=64)
    view = planner_view(llm, prompt_tokens=30, output_tokens=10, users=20, display=False)
    assert view.widget.result["users_fit"] == plan(llm, 30, 10, 20).users_fit
    view.widget.settings = {**view.widget.settings, "shared_prefix_tokens": 16}  # what a slider sends
    expected = plan(llm, 30, 10, 20, shared_prefix_tokens=16)
    assert view.widget.result["users_fit"] == expected.users_fit and view.widget.result["fits"]
    view.widget.settings = {**view.widget.settings, "kv_cache_memory_mib": 0.5}  # twice the pool's 0.25 MiB
    assert view.widget.result["num_blocks"] == 128 == plan(llm, 30, 10, kv_cache_memory=2**19).num_blocks
    view.widget.settings = {**view.widget.settings, "users": 0}
    assert view.widget.result == {"error": "users must be an int >= 1, got 0"}


def test_a_hybrid_model_counts_one_groups_layers_per_block_and_the_window(tmp_path):
    """Gemma-3-like layers (4 sliding of window 16, 2 full: 3 groups of 2 layers, engine/kv_cache_groups.py): a
    block is one group's 2 layers, a user holds blocks in every group but a sliding group only its window's
    (plus the chunks in flight), and a shared prefix is stored once in the full group. The users it says fit run
    with no preemption."""
    from tiny import make_tiny_model

    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                   "full_attention", "sliding_attention"]
    path = make_tiny_model(tmp_path / "hybrid", "qwen2", num_hidden_layers=6, use_sliding_window=True,
                           sliding_window=16, max_window_layers=0, layer_types=layer_types)
    with LLM(str(path), dtype="float32", block_size=BS, num_kv_blocks=96, max_model_len=128,
             max_num_batched_tokens=16, enable_prefix_caching=True) as llm:
        runner = llm.engine.runner
        p = plan(llm, prompt_tokens=60, output_tokens=20, shared_prefix_tokens=24)
        assert p.pool_bytes == 96 * runner.block_bytes() == sum(t.nbytes for t in runner.kv_cache_tensors)
        # the full group: ceil(80 / 8) = 10 blocks; each sliding group: min(80, 16 + 2 x 16) / 8 + 1 = 7
        assert p.blocks_per_user == 10 + 2 * 7
        assert p.shared_blocks == 24 // BS  # one full group
        assert p.users_fit == min((96 - 3) // (24 - 3), llm.engine.config.max_num_seqs) == 4
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        prompts = [[10 + (i + j) % 300 for j in range(60)] for i in range(p.users_fit)]
        llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["preemptions"] == 0
