"""pagednb's decoder reproduces HF transformers' logits, however the tokens are fed to the paged cache."""
from __future__ import annotations

import pytest
import torch
from tiny import make_tiny_model
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagednb.attention import AttentionMetadata, TorchReferenceBackend
from pagednb.model import load_hf_config, load_model, model_spec
from pagednb.model.rotary import rope_inv_freq

ATOL = 1e-4
BLOCK_SIZE = 4
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),  # sliding_window=24: prompts below are longer
    "llama3_rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "tied": ("llama", {"tie_word_embeddings": True}),
    "qwen3_sliding_layer": ("qwen3", {"use_sliding_window": True, "sliding_window": 10,
                                      "max_window_layers": 1}),
}


class PagedCache:
    """A KV cache for a few sequences, each owning distinct, shuffled blocks."""

    def __init__(self, spec, num_seqs: int, max_len: int, seed: int = 0) -> None:
        blocks_per_seq = -(-max_len // BLOCK_SIZE)
        num_blocks = num_seqs * blocks_per_seq + 3
        gen = torch.Generator().manual_seed(seed)
        perm = torch.randperm(num_blocks, generator=gen)[: num_seqs * blocks_per_seq]
        self.block_tables = perm.view(num_seqs, blocks_per_seq).int()
        shape = (2, num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [torch.zeros(shape) for _ in range(spec.num_layers)]

    def step(self, chunks: list[tuple[int, int, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """chunks: (seq, first position, count) per sequence in this step -> positions, metadata."""
        positions = torch.cat([torch.arange(start, start + n) for _, start, n in chunks])
        seqs = [seq for seq, _, _ in chunks]
        tables = self.block_tables[seqs].long()
        row_of = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor([n for *_, n in chunks]))
        slots = tables[row_of, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        starts = [0]
        for _, _, n in chunks:
            starts.append(starts[-1] + n)
        seq_lens = [start + n for _, start, n in chunks]
        metadata = AttentionMetadata(
            slot_mapping=slots, query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=self.block_tables[seqs],
            max_query_len=max(n for *_, n in chunks), max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)
        return positions, metadata


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, tmp_path_factory):
    """(pagednb model, HF model) sharing one tiny random checkpoint."""
    arch, overrides = VARIANTS[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)
    cfg = load_hf_config(path)
    ours = load_model(path, cfg, model_spec(cfg), torch.float32, torch.device("cpu"), TorchReferenceBackend())
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    return ours, theirs


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 384, (length,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    return hf_model(ids[None]).logits[0].float()


@torch.no_grad()
def run(model, cache: PagedCache, ids: torch.Tensor, chunks) -> torch.Tensor:
    positions, metadata = cache.step(chunks)
    return model.compute_logits(model(ids, positions, cache.kv_caches, metadata))


def test_prefill_logits_match_hf(models):
    ours, theirs = models
    ids = prompt(37, seed=0)
    logits = run(ours, PagedCache(ours.spec, 1, 40), ids, [(0, 0, len(ids))])
    assert logits.dtype == ours.model.embed_tokens.weight.dtype  # the model's dtype, as HF's LM head
    torch.testing.assert_close(logits, hf_logits(theirs, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decode_over_the_cache_match_hf(models):
    ours, theirs = models
    ids = prompt(41, seed=1)
    cache, pieces, start = PagedCache(ours.spec, 1, 48), [], 0
    for n in (7, 1, 12, 1, 1, 19):  # chunks over cached context, and single-token decode steps
        pieces.append(run(ours, cache, ids[start:start + n], [(0, start, n)]))
        start += n
    torch.testing.assert_close(torch.cat(pieces), hf_logits(theirs, ids), atol=ATOL, rtol=0)


def test_batch_of_prompts_of_different_lengths_in_one_forward(models):
    ours, theirs = models
    prompts = [prompt(n, seed=10 + n) for n in (5, 30, 1, 17)]
    chunks = [(i, 0, len(p)) for i, p in enumerate(prompts)]
    logits = run(ours, PagedCache(ours.spec, len(prompts), 32), torch.cat(prompts), chunks)
    expected = torch.cat([hf_logits(theirs, p) for p in prompts])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_mixed_step_of_decodes_and_a_prefill_chunk(models):
    ours, theirs = models
    a, b, c = prompt(29, seed=3), prompt(26, seed=4), prompt(12, seed=5)
    cache = PagedCache(ours.spec, 3, 32)
    run(ours, cache, torch.cat([a[:28], b[:25], c[:4]]), [(0, 0, 28), (1, 0, 25), (2, 0, 4)])
    step = run(ours, cache, torch.cat([a[28:], c[4:], b[25:]]), [(0, 28, 1), (2, 4, 8), (1, 25, 1)])
    expected = torch.cat([hf_logits(theirs, a)[28:], hf_logits(theirs, c)[4:], hf_logits(theirs, b)[25:]])
    torch.testing.assert_close(step, expected, atol=ATOL, rtol=0)


class _RopeConfig:
    """The minimum a rope-frequency function reads from a config."""

    def __init__(self, rope_parameters: dict) -> None:
        self.rope_parameters = {"rope_theta": 10000.0, **rope_parameters}
        self.hidden_size, self.num_attention_heads, self.head_dim = 64, 4, 16
        self.max_position_embeddings = 512

    def standardize_rope_params(self) -> None:
        pass


@pytest.mark.parametrize("params", [
    {"rope_type": "linear", "factor": 4.0},
    LLAMA3_ROPE,
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16,
     "mscale": 1.0, "mscale_all_dim": 0.5},
], ids=lambda p: p["rope_type"])
def test_rope_frequencies_match_hf(params):
    cfg = _RopeConfig(params)
    inv_freq, scaling = rope_inv_freq(cfg, 16)
    hf_inv_freq, hf_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, torch.device("cpu"))
    torch.testing.assert_close(inv_freq, hf_inv_freq, atol=0, rtol=0)
    assert scaling == pytest.approx(hf_scaling)


def test_unknown_rope_type_is_refused_by_name():
    with pytest.raises(ValueError, match="'dynamic'.*default, linear, llama3, yarn"):
        rope_inv_freq(_RopeConfig({"rope_type": "dynamic", "factor": 2.0}), 16)
