"""The decode stage through the pipeline: greedy, sampling, stop strings, EOS, streaming, limits."""

from __future__ import annotations

import pytest
import torch
from conftest import FakeTokenizer, make_prompt

from kvsieve import GemFilter, KvsieveError, Prompt, Sampling, run
from kvsieve.decode import eos_token_ids, next_token

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("arch_name", ["llama", "qwen2"])
@pytest.mark.parametrize("reference", ["kvsieve", "sdpa"])
def test_greedy_matches_model_generate(arch_name, reference, make_model):
    model = make_model(arch_name, num_layers=3)
    prompt = make_prompt(40)
    result = run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=12))
    if reference != "kvsieve":
        model.set_attn_implementation(reference)
    with torch.no_grad():
        generated = model.generate(
            prompt.ids,
            attention_mask=torch.ones_like(prompt.ids),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    expected = generated[0, prompt.length :].tolist()
    assert len(expected) == 12
    assert result.tokens == expected
    assert result.text == FakeTokenizer().decode(expected)
    assert result.finish_reason == "length"
    assert result.prompt_tokens == 40
    assert len(set(expected)) > 1  # a real continuation, not one token repeated by a broken model


def test_sampling_is_reproducible_per_seed_and_varies_across_seeds(make_model):
    model = make_model("llama")
    prompt = make_prompt(20)

    def sample(seed):
        sampling = Sampling(max_new_tokens=10, temperature=5.0, seed=seed)
        return run(model, FakeTokenizer(), prompt, sampling=sampling).tokens

    first = sample(0)
    assert sample(0) == first
    others = [sample(seed) for seed in (1, 2, 3)]
    # With a near-flat distribution over 256 tokens, 10 equal draws in a row are practically impossible.
    assert all(tokens != first for tokens in others)
    greedy = run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=10)).tokens
    assert first != greedy
    unseeded = run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=10, temperature=5.0))
    assert unseeded.stages[-1].method == "sampling"
    assert len(unseeded.tokens) == 10


def test_tiny_top_p_equals_greedy(make_model):
    model = make_model("qwen2")
    prompt = make_prompt(24)
    greedy = run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=10))
    for seed, top_p in ((0, 1e-6), (1, 1e-6), (2, 2e-284)):  # the last is 0 in float32: still the likeliest token
        sampling = Sampling(max_new_tokens=10, temperature=1.5, top_p=top_p, seed=seed)
        nucleus = run(model, FakeTokenizer(), prompt, sampling=sampling)
        assert nucleus.tokens == greedy.tokens
    assert greedy.stages[-1].method == "greedy"


def test_top_k_one_equals_greedy_and_min_tokens_holds_eos_back(make_model, monkeypatch):
    import kvsieve.engine.scheduler

    model = make_model("llama")
    prompt = make_prompt(24)
    greedy = run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=10))
    for seed in (0, 1):
        top_one = Sampling(max_new_tokens=10, temperature=1.5, top_k=1, seed=seed)
        assert run(model, FakeTokenizer(), prompt, sampling=top_one).tokens == greedy.tokens
    first = greedy.tokens[0]  # make the greedy first token the EOS
    monkeypatch.setattr(kvsieve.engine.scheduler, "eos_token_ids", lambda model, tokenizer: {first})
    assert run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=10)).tokens == [first]
    held = run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=10, min_tokens=3)).tokens
    assert len(held) >= 3 and first not in held[:3]
    with pytest.raises(KvsieveError, match="min_tokens"):
        run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=2, min_tokens=3))
    with pytest.raises(KvsieveError, match="64 bits"):
        run(model, FakeTokenizer(), prompt, sampling=Sampling(temperature=1.0, seed=2**70))


def test_next_token_top_p_keeps_the_smallest_prefix_reaching_p():
    # probs (temperature 1): 0.5, 0.3, 0.2 -> top_p 0.6 keeps tokens 0 and 1, never token 2.
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    generator = torch.Generator().manual_seed(0)
    picks = {next_token(logits, Sampling(temperature=1.0, top_p=0.6), generator) for _ in range(200)}
    assert picks == {0, 1}
    picks = {next_token(logits, Sampling(temperature=1.0, top_p=0.5), generator) for _ in range(50)}
    assert picks == {0}
    assert next_token(torch.tensor([0.1, 3.0, -1.0]), Sampling(), None) == 1


def _reference_tokens(model, prompt, n=10):
    return run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=n)).tokens


def test_stop_string_cuts_text(make_model):
    model = make_model("llama")
    prompt = make_prompt(20)
    tokens = _reference_tokens(model, prompt)
    tok = FakeTokenizer()
    stop_token = tokens[4]
    first = tokens.index(stop_token)
    stop = f"<{stop_token}>"
    result = run(model, tok, prompt, sampling=Sampling(max_new_tokens=10, stop=(stop,)))
    assert result.finish_reason == "stop"
    assert stop not in result.text
    assert result.text == tok.decode(tokens[:first])
    assert result.tokens == tokens[: first + 1]


def test_stop_string_spanning_two_tokens_and_the_earliest_of_several(make_model):
    model = make_model("llama")
    prompt = make_prompt(20)
    tokens = _reference_tokens(model, prompt)
    tok = FakeTokenizer()
    full_text = tok.decode(tokens)
    spanning = f"{tokens[5]}><{tokens[6]}"  # starts inside token 5's text, ends inside token 6's
    later = f"<{tokens[8]}>"
    cut = full_text.find(spanning)
    assert cut >= 0
    result = run(model, tok, prompt, sampling=Sampling(max_new_tokens=10, stop=(later, spanning)))
    assert result.finish_reason == "stop"
    expected_cut = min(cut, full_text.find(later))
    assert result.text == full_text[:expected_cut]
    assert spanning not in result.text and later not in result.text


def test_eos_ends_decoding_and_is_kept_in_tokens_only(make_model):
    model = make_model("qwen2")
    prompt = make_prompt(20)
    tokens = _reference_tokens(model, prompt)
    eos = tokens[3]
    first = tokens.index(eos)
    result = run(model, FakeTokenizer(eos_token_id=eos), prompt, sampling=Sampling(max_new_tokens=10))
    assert result.finish_reason == "eos"
    assert result.tokens == tokens[: first + 1]
    assert result.text == FakeTokenizer().decode(tokens[:first])
    # The model's generation config can name EOS ids too (possibly a list).
    model.generation_config.eos_token_id = [eos, 999]
    assert eos_token_ids(model, FakeTokenizer(eos_token_id=7)) == {eos, 999, 7}
    result = run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=10))
    assert result.finish_reason == "eos" and result.tokens == tokens[: first + 1]


def test_ignore_eos_decodes_past_eos_to_the_token_limit(make_model):
    """ignore_eos: the same greedy tokens as without EOS, EOS included, until max_new_tokens."""
    model = make_model("qwen2")
    prompt = make_prompt(20)
    tokens = _reference_tokens(model, prompt)
    eos = tokens[3]
    sampling = Sampling(max_new_tokens=10, ignore_eos=True)
    result = run(model, FakeTokenizer(eos_token_id=eos), prompt, sampling=sampling)
    assert result.finish_reason == "length"
    assert result.tokens == tokens[:10] and eos in result.tokens[:4]
    assert result.kv_cache_length == prompt.length + 9


def test_max_new_tokens_limits_length(make_model):
    model = make_model("llama")
    prompt = make_prompt(20)
    for n in (1, 3):
        result = run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=n))
        assert len(result.tokens) == n
        assert result.finish_reason == "length"
        assert result.kv_cache_length == prompt.length + n - 1


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        (Sampling(max_new_tokens=0), "max_new_tokens"),
        (Sampling(temperature=-0.1), "temperature"),
        (Sampling(top_p=0.0), "top_p"),
        (Sampling(top_p=1.01), "top_p"),
        (Sampling(stop=("ok", "")), "Stop strings"),
    ],
)
def test_sampling_validate_errors(sampling, message, make_model):
    with pytest.raises(KvsieveError, match=message):
        sampling.validate()
    with pytest.raises(KvsieveError, match=message):
        run(make_model("llama"), FakeTokenizer(), make_prompt(10), sampling=sampling)


def test_sampling_edges_are_accepted_and_mean_what_they_say(make_model):
    """One new token is one token; a nucleus of 1e-9 holds only the likeliest token, so sampling at any
    temperature gives the greedy answer."""
    model, prompt = make_model("llama"), make_prompt(10)
    one = Sampling(max_new_tokens=1, temperature=0.0, top_p=1.0)
    one.validate()
    assert len(run(model, FakeTokenizer(), prompt, sampling=one).tokens) == 1
    narrow = Sampling(max_new_tokens=6, temperature=2.0, top_p=1e-9, seed=3, stop=("x",))
    narrow.validate()
    greedy = run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=6)).tokens
    assert run(model, FakeTokenizer(), prompt, sampling=narrow).tokens == greedy


@pytest.mark.parametrize("stop", [(), ("NEVER-IN-TEXT",), "token", "spanning"])
def test_streamed_pieces_concatenate_to_the_final_text(stop, make_model):
    model = make_model("llama")
    prompt = make_prompt(20)
    tokens = _reference_tokens(model, prompt, 12)
    if stop == "token":
        stop = (f"<{tokens[7]}>",)
    elif stop == "spanning":  # must be held back: its start is already in the text one token earlier
        stop = (f"{tokens[7]}><{tokens[8]}",)
    pieces = []
    result = run(model, FakeTokenizer(), prompt, sampling=Sampling(max_new_tokens=12, stop=stop), stream=pieces.append)
    assert "".join(pieces) == result.text
    assert result.finish_reason == ("stop" if stop and "NEVER" not in stop[0] else "length")
    assert len(pieces) > 1  # really streamed, not one piece at the end
    assert all(pieces)


def test_a_prompt_of_two_rows_is_refused(make_model):
    ids = torch.randint(3, 200, (2, 10))
    with pytest.raises(KvsieveError, match="one row .* list of prompts"):
        run(make_model("llama"), FakeTokenizer(), Prompt(ids=ids, context_start=0, context_len=10))
    with pytest.raises(KvsieveError, match="one row"):
        run(make_model("llama"), FakeTokenizer(), Prompt(ids=ids[0], context_start=0, context_len=10))


def test_one_position_rule_composes_selection_with_the_later_stages():
    from kvsieve import ChunkedPrefill, Evict, StreamingLLM
    from kvsieve.engine.pipeline import positions_needed

    reencode = Evict(StreamingLLM(reencode=True), 16)
    assert positions_needed({"evict": reencode}, 8, 1000) == 16 + 1  # budget + interval, not the stream's length
    # After GemFilter, the kept 8 tokens follow the same rule: the 60-token scoring pass is the bound.
    assert positions_needed({"select": GemFilter(k=8), "evict": reencode}, 60, 1000) == 60
    assert positions_needed({"select": GemFilter(k=8)}, 60, 1000) == 1008
    assert positions_needed({"feed": ChunkedPrefill()}, 100_000, 10) == 0  # checked after the feed ran


def test_prompt_beyond_max_positions_is_refused(make_model):
    model = make_model("llama", max_positions=64)
    with pytest.raises(KvsieveError, match="positions") as info:
        run(model, FakeTokenizer(), make_prompt(60), sampling=Sampling(max_new_tokens=10))
    message = str(info.value)
    assert "10 new tokens" in message and "70 positions" in message and "64" in message
    with pytest.raises(KvsieveError, match="70 tokens"):
        run(model, FakeTokenizer(), make_prompt(70), sampling=Sampling(max_new_tokens=1))
    # GemFilter's scoring pass sees every prompt position too ...
    with pytest.raises(KvsieveError, match="70 tokens"):
        run(model, FakeTokenizer(), make_prompt(70), select=GemFilter(k=8, layer=0), sampling=Sampling(1))
    # ... but decoding only needs room after the k kept tokens.
    result = run(
        model, FakeTokenizer(), make_prompt(60), select=GemFilter(k=8, layer=0), sampling=Sampling(max_new_tokens=10)
    )
    assert len(result.tokens) == 10
    # Exactly filling the context is allowed.
    result = run(model, FakeTokenizer(), make_prompt(54), sampling=Sampling(max_new_tokens=10))
    assert len(result.tokens) == 10
