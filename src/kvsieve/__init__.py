"""kvsieve: faster, smaller long-context inference for Hugging Face causal LMs.

The flow is select -> feed -> compress -> decode; a method names one option per stage:

    from kvsieve import load_model, generate, method, Sampling
    model, tokenizer = load_model()                      # embedded SmolLM2-135M-Instruct
    result = generate(model, tokenizer, long_text, "What is the pass key?",
                      method=method("gemfilter", {"select.k": 1024}), sampling=Sampling(max_new_tokens=32))
"""

from kvsieve.attention.critiprefill import CritiPrefill
from kvsieve.compress.policies.a2sf import A2SF
from kvsieve.compress.policies.collie import Collie
from kvsieve.compress.policies.h2o import H2O
from kvsieve.compress.policies.knorm import KNorm
from kvsieve.compress.policies.local import LocalWindow
from kvsieve.compress.policies.snapkv import SnapKV
from kvsieve.compress.policies.streaming import StreamingLLM
from kvsieve.compress.policies.tova import TOVA
from kvsieve.compress.stages import Compress, Evict
from kvsieve.decode import Sampling
from kvsieve.engine import GenerationResult, RunState, StageRecord, generate, run
from kvsieve.errors import KvsieveError
from kvsieve.feed.chunked import ChunkedPrefill
from kvsieve.feed.full import FullPrefill
from kvsieve.integrations import pipeline_task as pipeline_task  # registers pipeline("kvsieve-text-generation")
from kvsieve.integrations.custom_generate import decoding
from kvsieve.loading import load_model
from kvsieve.models import architecture
from kvsieve.preparation import prepare
from kvsieve.prompt import Prompt, build_prompt
from kvsieve.registry import REGISTRY, method, register
from kvsieve.select.gemfilter import GemFilter
from kvsieve.spec import MethodSpec

__all__ = [
    "A2SF",
    "ChunkedPrefill",
    "Collie",
    "Compress",
    "CritiPrefill",
    "Evict",
    "FullPrefill",
    "GemFilter",
    "GenerationResult",
    "H2O",
    "KNorm",
    "KvsieveError",
    "LocalWindow",
    "MethodSpec",
    "Prompt",
    "REGISTRY",
    "RunState",
    "Sampling",
    "SnapKV",
    "StageRecord",
    "StreamingLLM",
    "TOVA",
    "architecture",
    "build_prompt",
    "decoding",
    "generate",
    "load_model",
    "method",
    "prepare",
    "register",
    "run",
]
