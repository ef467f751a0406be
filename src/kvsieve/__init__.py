"""kvsieve: faster, smaller long-context inference for Hugging Face causal LMs.

The flow is select -> feed -> compress -> decode; pick one option per stage:

    from kvsieve import load_model, generate, GemFilter, Sampling
    model, tokenizer = load_model()                      # embedded SmolLM2-135M-Instruct
    result = generate(model, tokenizer, long_text, "What is the pass key?",
                      select=GemFilter(k=1024), sampling=Sampling(max_new_tokens=32))
"""

from kvsieve.attention.critiprefill import CritiPrefill
from kvsieve.compress.methods import A2SF, H2O, LocalWindow, SnapKV, StreamingLLM
from kvsieve.compress.stages import Compress, Evict
from kvsieve.decode import Sampling
from kvsieve.errors import KvsieveError
from kvsieve.feed.chunked import ChunkedPrefill
from kvsieve.feed.full import FullPrefill
from kvsieve.models import architecture, load_model, prepare
from kvsieve.pipeline import GenerationResult, StageRecord, generate, run
from kvsieve.prompt import Prompt, build_prompt
from kvsieve.select.gemfilter import GemFilter

__all__ = [
    "A2SF",
    "ChunkedPrefill",
    "Compress",
    "CritiPrefill",
    "Evict",
    "H2O",
    "LocalWindow",
    "SnapKV",
    "StreamingLLM",
    "FullPrefill",
    "GemFilter",
    "GenerationResult",
    "KvsieveError",
    "Prompt",
    "Sampling",
    "StageRecord",
    "architecture",
    "build_prompt",
    "generate",
    "load_model",
    "prepare",
    "run",
]
