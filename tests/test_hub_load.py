"""`load_model` with a Hugging Face model id, served offline from a fake local Hugging Face cache.

huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE when it is imported, so the checks run
kvsieve in a subprocess with those variables set (one process for both checks: its startup is most
of the cost). The cache has the layout `hf download` makes: `models--ORG--NAME/snapshots/<commit>/...`
and `models--ORG--NAME/refs/main` naming the commit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import build_model, make_prompt, word_level_tokenizer

# One worker runs both tests, so the module's offline run (a subprocess, about 5 s) happens once.
pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.xdist_group("offline_hub")]

MODEL_ID = "kvsieve-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def run_offline(hub: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("HF_HOME", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def offline_hub(tmp_path_factory):
    """A fake cache holding the tiny Llama under MODEL_ID (and nothing else), and one offline run on it.

    The run loads MODEL_ID, then tries the uncached "kvsieve-test/not-cached". Each check is in its
    own try block and prints one line tagged LOADED or MISSING (or its traceback to stderr), so one
    failing does not hide the other's result.
    """
    tmp_path = tmp_path_factory.mktemp("offline-hub")
    original = build_model("llama")
    hub = tmp_path / "hub"
    repo = hub / ("models--" + MODEL_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    original.save_pretrained(snapshot)
    word_level_tokenizer().save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)

    ids = make_prompt(16).ids
    code = f"""
        import json, torch, traceback
        torch.set_num_threads(1)
        import kvsieve
        try:
            model, tokenizer = kvsieve.load_model({MODEL_ID!r}, device="cpu", dtype="bfloat16")
            ids = torch.tensor({ids.tolist()!r})
            with torch.no_grad():
                logits = model(ids).logits[0]
            parameter = next(model.parameters())
            print("LOADED", json.dumps({{
                "model_type": model.config.model_type,
                "attn": model.config._attn_implementation,
                "dtype": str(parameter.dtype),
                "device": str(parameter.device),
                "next_ids": logits.argmax(-1).tolist(),
                "last_logits": logits[-1].float().tolist(),
                "tokens": tokenizer("the pass key", add_special_tokens=False)["input_ids"],
            }}))
        except Exception:
            traceback.print_exc()
        try:
            kvsieve.load_model("kvsieve-test/not-cached", device="cpu")
        except kvsieve.KvsieveError as error:
            print("MISSING", json.dumps("KvsieveError: " + str(error)))
        except Exception:
            traceback.print_exc()
        else:
            print("MISSING", json.dumps("loaded"))
    """
    # cwd has no "kvsieve-test" folder, so the id cannot be mistaken for a local path.
    result = run_offline(hub, code, cwd=tmp_path)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.startswith(("LOADED ", "MISSING ")))
    return hub, original, ids, result, {tag: json.loads(text) for tag, text in lines.items()}


def test_model_id_loads_from_the_offline_hf_cache(offline_hub):
    hub, original, ids, result, printed = offline_hub
    assert result.returncode == 0 and "LOADED" in printed, result.stderr
    loaded = printed["LOADED"]

    # The original model in bfloat16, as from_pretrained(dtype=bfloat16) builds it: every weight
    # cast, the RoPE inverse frequencies kept in float32.
    rotary = original.model.rotary_emb
    inv_freq = {name: buffer.clone() for name, buffer in rotary.named_buffers()}
    reference = original.to(torch.bfloat16)
    for name, buffer in inv_freq.items():
        setattr(rotary, name, buffer)
    with torch.no_grad():
        expected = reference(ids).logits[0]
    last_logits = torch.tensor(loaded.pop("last_logits"))
    torch.testing.assert_close(last_logits, expected[-1].float(), rtol=0, atol=0)
    assert loaded == {
        "model_type": "llama",
        "attn": "kvsieve",
        "dtype": "torch.bfloat16",
        "device": "cpu",
        "next_ids": expected.argmax(-1).tolist(),
        "tokens": [3, 4, 5],
    }


def test_model_id_missing_from_the_offline_cache_is_explained(offline_hub):
    hub, _, _, result, printed = offline_hub
    assert result.returncode == 0 and "MISSING" in printed, result.stderr
    message = printed["MISSING"]
    assert message.startswith("KvsieveError:"), message
    assert "'kvsieve-test/not-cached'" in message
    assert str(hub) in message  # where it looked
    assert "HF_HUB_OFFLINE=1" in message  # that the network was off
    assert "hf download kvsieve-test/not-cached" in message  # how to fix it
