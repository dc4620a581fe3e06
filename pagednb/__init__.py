"""pagednb: a small, fast paged-attention LLM engine that runs inside the notebook kernel."""
import logging as _logging

from pagednb.llm import LLM
from pagednb.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagednb.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "RequestOutputKind",
           "Logprob", "StructuredOutputsParams"]
__version__ = "0.1.0"

_logger = _logging.getLogger("pagednb")
if not _logger.handlers:  # say what the engine decided (pool size, model load) unless the user set logging up
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("[pagednb] %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(_logging.INFO)
