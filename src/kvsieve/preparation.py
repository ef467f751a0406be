"""Making a model ready for kvsieve: the one step every entry point takes before it runs a model (`load_model`, the
transformers pipeline task, `decoding`, and users who loaded a model themselves).

It stands above the architecture adapter (`models.py`), the attention function (`attention/`) and the kernels, the
three things it joins, so that none of them imports another to prepare a model.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from kvsieve.attention import ATTENTION_NAME
from kvsieve.kernels.products import fuse_linears
from kvsieve.models import architecture


def prepare(model: PreTrainedModel) -> PreTrainedModel:
    """Check that kvsieve supports `model`, route its attention through kvsieve's function and give its linear
    layers the fused CPU product for decoding steps (`kvsieve.kernels.products.fuse_linears`).

    The function is registered with transformers' public AttentionInterface; no model class is
    patched. Without hooks active it computes plain causal SDPA attention.
    """
    architecture(model)
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
    return fuse_linears(model).eval()
