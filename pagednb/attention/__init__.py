"""Attention: the metadata/backend seam and the pure-torch reference backend."""
from pagednb.attention.backend import AttentionBackend, AttentionMetadata
from pagednb.attention.torch_ref import TorchReferenceBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchReferenceBackend"]
