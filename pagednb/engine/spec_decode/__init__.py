"""Speculative decoding with n-gram drafts (prompt lookup), as vLLM's `speculative_config={"method": "ngram"}`.

config.py: the checked options. ngram_proposer.py: drafts from a request's own tokens. drafter.py: which
running requests get drafts each step. verify_rows.py: a request's 1 + d verify tokens as one-token decode
rows of the attention metadata. verifier.py: the accepted run of each request from its sampled rows.
"""
from pagednb.engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
