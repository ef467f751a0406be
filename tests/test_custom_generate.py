"""kvsieve inside transformers' `generate` (`custom_generate=kvsieve.decoding(method)`), on tiny random-weight models:
full attention gives transformers' own greedy tokens, every method gives the tokens `kvsieve.run` gives on the same
ids, a padded batch gives each row what it gets alone, and what the engine cannot do is refused by name."""

from __future__ import annotations

import pytest
import torch
from conftest import FakeTokenizer, build_model
from transformers.generation.streamers import BaseStreamer

import kvsieve
from kvsieve import KvsieveError, Sampling
from kvsieve.prompt import ids_prompt

PRESET_SETTINGS = {  # budgets that bite on a 48-token prompt
    "gemfilter": {"select.k": 24, "select.layer": 2},  # a global layer of the tiny Gemma 3 too
    "snapkv": {"compress.budget": 24, "compress.policy.window": 8},
    "a2sf": {"evict.budget": 24},
    "imdc": {"feed.chunk": 16, "feed.memory": 16},
    "critiprefill": {"attention.segment": 16, "attention.block": 4, "attention.budget": 8},
}


def ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["llama", "gemma3"])
def model(request, single_thread):
    model = build_model(request.param, num_layers=3)
    model.generation_config.eos_token_id = None
    return model


def test_full_gives_transformers_own_greedy_tokens(single_thread):
    plain = build_model("llama", num_layers=3)
    plain.set_attn_implementation("sdpa")  # transformers' own attention, as a user's model comes
    prompt = ids(40)
    expected = plain.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = plain.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0, custom_generate=kvsieve.decoding())
    assert got.tolist() == expected.tolist()
    assert plain.config._attn_implementation == "kvsieve"  # prepared on the way, as `decoding` says


@pytest.mark.parametrize("options", [{}, {"repetition_penalty": 1.3, "min_new_tokens": 6}])
def test_full_gives_transformers_own_scores_and_logits(options, single_thread):
    """`scores` are each step's logits through the call's own processors (here the repetition penalty and the least
    new tokens), `logits` the raw ones, as transformers' own greedy decoding returns them."""
    plain = build_model("llama", num_layers=3)
    plain.set_attn_implementation("sdpa")
    asked = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True,
             "output_scores": True, "output_logits": True, **options}  # fmt: skip
    expected = plain.generate(ids(40), **asked)
    got = plain.generate(ids(40), **asked, custom_generate=kvsieve.decoding())
    assert got.sequences.tolist() == expected.sequences.tolist()
    assert len(got.scores) == len(expected.scores) == 6 and len(got.logits) == 6
    pairs = [*zip(got.scores, expected.scores, strict=True), *zip(got.logits, expected.logits, strict=True)]
    for mine, theirs in pairs:
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    if options:  # the processors changed the scores: the test compares processed values, not raw twice
        assert not torch.allclose(got.scores[1], got.logits[1])


class Recording(BaseStreamer):
    """A streamer that records what it is given: each put's ids, and whether it ended."""

    def __init__(self, tokenizer=None):
        self.tokenizer, self.puts, self.ended = tokenizer, [], 0

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("tokenizer", [None, FakeTokenizer()])
def test_a_streamer_receives_the_prompt_then_the_answer(tokenizer, single_thread):
    """transformers' streamer contract: the prompt first, then the answer's ids (as their text becomes final when the
    streamer has a tokenizer; at the end without one), then one end(); the same ids `generate` returns."""
    model = build_model("llama", num_layers=3)
    model.generation_config.eos_token_id = None
    streamer = Recording(tokenizer)
    out = model.generate(ids(30), max_new_tokens=6, do_sample=False, pad_token_id=0, streamer=streamer,
                         custom_generate=kvsieve.decoding("snapkv", PRESET_SETTINGS["snapkv"]))  # fmt: skip
    assert streamer.puts[0] == ids(30)[0].tolist() and streamer.ended == 1
    assert sum(streamer.puts[1:], []) == out[0, 30:].tolist()
    assert len(streamer.puts) == (7 if tokenizer is not None else 2)  # one put per final piece, or one at the end
    with pytest.raises(KvsieveError, match="A streamer takes one prompt"):
        model.generate(torch.cat([ids(30), ids(30, seed=2)]), max_new_tokens=2, pad_token_id=0,
                       streamer=Recording(), custom_generate=kvsieve.decoding())  # fmt: skip


class Periods(FakeTokenizer):
    """FakeTokenizer whose id 7 reads as a period: where a sentence ends, for the stand-in question."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "." if list(ids) == [7] else super().decode(ids, skip_special_tokens)


def test_the_stand_in_question_reads_the_tokenizer_given_to_generate(monkeypatch, single_thread):
    """The tokenizer given to `decoding` reaches the stand-in rule (`question_tail`): the window reaches back to the
    sentence start the tokenizer shows; without one, the 16-token window alone."""
    from kvsieve.integrations import custom_generate

    model = build_model("llama", num_layers=3)
    model.generation_config.eos_token_id = None
    prompt = ids(60)
    prompt[0, 60 - 25 :] = 5  # no period among the last 25 tokens
    prompt[0, 60 - 26] = 7  # a period before them: a 25-token sentence ends the prompt
    tails = []
    real = custom_generate.ids_prompt
    monkeypatch.setattr(
        custom_generate, "ids_prompt", lambda *a, **k: tails.append(real(*a, **k).tail_len) or real(*a, **k)
    )
    for tokenizer in (Periods(), None):
        model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0,
                       custom_generate=kvsieve.decoding("imdc", PRESET_SETTINGS["imdc"], tokenizer))  # fmt: skip
    assert tails == [25, 16]


@pytest.mark.parametrize("name", list(PRESET_SETTINGS))
def test_each_method_gives_the_tokens_kvsieve_run_gives(name, model):
    prompt = ids(48)
    settings = PRESET_SETTINGS[name]
    out = model.generate(
        prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, custom_generate=kvsieve.decoding(name, settings)
    )
    alone = kvsieve.run(
        model, FakeTokenizer(), ids_prompt(prompt[0].tolist()), method=kvsieve.method(name, settings),
        sampling=Sampling(max_new_tokens=6),
    )  # fmt: skip
    assert out[0, :48].tolist() == prompt[0].tolist() and out[0, 48:].tolist() == alone.tokens


def test_a_left_padded_batch_gives_each_row_its_own_answer(model):
    short, long = ids(30, seed=2), ids(40, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 10, dtype=torch.long), short], 1), long])
    mask = (torch.arange(40) >= torch.tensor([[10], [0]])).long()
    decode = kvsieve.decoding("snapkv", {"compress.budget": 16, "compress.policy.window": 8})
    out = model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                         custom_generate=decode, return_dict_in_generate=True)  # fmt: skip
    for row, prompt in enumerate((short, long)):
        alone = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0, custom_generate=decode)
        assert out.sequences[row, 40:].tolist() == alone[0, prompt.shape[1] :].tolist()


def test_sampling_follows_the_generation_config(model):
    """top_k=1 keeps only the likeliest token: sampling then gives the greedy answer, at any temperature."""
    prompt = ids(32)
    greedy = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0,
                            custom_generate=kvsieve.decoding())  # fmt: skip
    sampled = model.generate(prompt, max_new_tokens=6, do_sample=True, temperature=1.7, top_k=1, pad_token_id=0,
                             custom_generate=kvsieve.decoding())  # fmt: skip
    assert sampled.tolist() == greedy.tolist()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_beams": 2}, "does not run beam search"),
        ({"output_attentions": True, "return_dict_in_generate": True}, "does not return output_attentions"),
        ({"eos_token_id": 7}, "asks to stop at EOS [7]"),
        ({"no_repeat_ngram_size": 2}, "cannot apply NoRepeatNGramLogitsProcessor"),
    ],
)
def test_what_it_cannot_do_is_refused_by_name(options, message, single_thread):
    model = build_model("llama", num_layers=2)
    with pytest.raises(KvsieveError, match=message.replace("[", r"\[").replace("]", r"\]")):
        model.generate(ids(20), max_new_tokens=3, pad_token_id=0, custom_generate=kvsieve.decoding(), **options)


def test_assisted_generation_is_refused_rather_than_ignored(single_thread):
    """transformers hands a callable decoding method no assistant: kvsieve finds it in the call and refuses it."""
    model, assistant = build_model("llama", num_layers=2), build_model("llama", num_layers=1, seed=3)
    for options in ({"assistant_model": assistant}, {"prompt_lookup_num_tokens": 3}):
        with pytest.raises(KvsieveError, match="does not run assisted"):
            model.generate(ids(20), max_new_tokens=3, pad_token_id=0, custom_generate=kvsieve.decoding(), **options)


def test_an_eos_narrower_than_the_models_is_refused(single_thread):
    """The engine stops at every EOS id the model lists: a call asking for fewer could be stopped where it did not
    ask, so it is refused; the model's own ids (the default) are decoded."""
    model = build_model("llama", num_layers=2)
    model.generation_config.eos_token_id = [2, 3]
    with pytest.raises(KvsieveError, match=r"asks to stop at EOS \[2\], the model stops at \[2, 3\]"):
        model.generate(ids(20), max_new_tokens=3, pad_token_id=0, eos_token_id=2, custom_generate=kvsieve.decoding())
    out = model.generate(ids(20), max_new_tokens=3, pad_token_id=0, custom_generate=kvsieve.decoding())
    assert 20 < out.shape[1] <= 23


def test_a_bad_method_fails_before_generation():
    with pytest.raises(KvsieveError, match="Unknown method 'pyramid'"):
        kvsieve.decoding("pyramid")
    with pytest.raises(KvsieveError, match="has no field 'nope'"):
        kvsieve.decoding("snapkv", {"compress.nope": 1})


@pytest.mark.real_model
def test_smollm2_answers_through_generate_as_through_the_engine(smollm):
    """The embedded model: a passkey question, its chat template's ids given to `generate` with SnapKV at half the
    prompt, answers it with the tokens `kvsieve.run` gives on the same ids."""
    from kvsieve.data import passkey_case

    model, tokenizer = smollm
    case = passkey_case(tokenizer, 400, 0.5, seed=5)
    messages = [{"role": "user", "content": f"{case.context}\n\n{case.question}"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    settings = {"compress.budget": 0.5}
    out = model.generate(
        **inputs, max_new_tokens=16, do_sample=False, custom_generate=kvsieve.decoding("snapkv", settings)
    )
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    alone = kvsieve.run(
        model, tokenizer, ids_prompt(inputs["input_ids"][0].tolist()), method=kvsieve.method("snapkv", settings),
        sampling=Sampling(max_new_tokens=16),
    )  # fmt: skip
    assert new[: len(alone.tokens)] == alone.tokens and case.answer in tokenizer.decode(new, skip_special_tokens=True)


@pytest.mark.real_model
def test_a_prompt_that_names_no_question_is_guided_by_its_tail(smollm):
    """Token ids carry no question, yet IMDC's pruning is guided by one: the prompt's last tokens stand in for it
    (`kvsieve.prompt.question_tail`, the rule the server's completions share). On this 1,200-token passkey prompt
    at a memory of 192 entries, only the guided pruning keeps the key (benchmarks/question_window.py: 8 of 12 such
    cases guided by the last 16 tokens, 0 of 12 unguided; 18 of 18 against 0 of 18 at 3,000 tokens and 512)."""
    from kvsieve.data import passkey_case

    model, tokenizer = smollm
    case = passkey_case(tokenizer, 1200, 0.5, seed=0)
    messages = [{"role": "user", "content": f"{case.context}\n\n{case.question}"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    answers = {}
    for guided in (True, False):
        settings = {"feed.chunk": 192, "feed.memory": 192, "feed.question_guided": guided}
        out = model.generate(**inputs, max_new_tokens=10, do_sample=False,
                             custom_generate=kvsieve.decoding("imdc", settings))  # fmt: skip
        answers[guided] = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert case.answer in answers[True] and case.answer not in answers[False], answers
