"""`pipeline("kvsieve-text-generation")`: kvsieve as a transformers pipeline task, registered when kvsieve is imported.

    from transformers import pipeline
    import kvsieve  # registers the task
    pipe = pipeline("kvsieve-text-generation")  # the embedded SmolLM2; or model="id", a folder, a loaded model
    pipe(long_text, question="What is the pass key?", method="snapkv", set={"compress.budget": 0.25})
    pipe(long_text, questions=["Who?", "When?"])  # the context prefilled once, every question continues from it

The pipeline is a thin front over `kvsieve.generate` (the engine every entry point shares): a list of contexts is
one batch of the engine (not transformers' item-by-item loop), `questions` reuse one prefill of the context
(question-agnostic at `reuse_budget`), and the generation options are read as `model.generate(custom_generate=...)`
reads them
(`generation_config.sampling_of`). Each answer is a dict: `generated_text` (the answer alone, as text-generation's
`return_full_text=False`) plus what kvsieve measured (`GenerationResult.to_dict`: KV entries kept, stages, times).

A model named by id or folder is loaded by `kvsieve.load_model` (transformers' `pipeline` calls this task's model
class, `KvsieveModel`); a GGUF file as transformers names one, `model=FOLDER, model_kwargs={"gguf_file": NAME}`; no
model at all is the embedded default, converted from its wheel the first time; a model the user loaded is prepared.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer
from transformers.pipelines import PIPELINE_REGISTRY
from transformers.pipelines.base import Pipeline

from kvsieve.decode import Sampling
from kvsieve.engine import GenerationResult, generate, resolve_method
from kvsieve.errors import KvsieveError
from kvsieve.integrations.generation_config import check_eos, refuse_what_it_cannot_do, sampling_of
from kvsieve.loading import DEFAULT, load_model, tokenizer_of
from kvsieve.preparation import prepare
from kvsieve.spec import MethodSpec

TASK = "kvsieve-text-generation"
DEFAULT_METHOD = "gemfilter"  # the CLI's default too


@dataclass(frozen=True)
class Contexts:
    """Several contexts given as one list: one input to transformers' pipeline machinery (which would run a list
    item by item), so that the engine runs them as one batch."""

    texts: tuple[str, ...]


class KvsieveTextGenerationPipeline(Pipeline):
    """Answers questions about long contexts with a kvsieve method; see the module docstring."""

    _load_tokenizer = False  # the tokenizer `load_model` loaded with the model (`tokenizer_of`), or the caller's
    _load_processor = _load_image_processor = _load_video_processor = _load_feature_extractor = False

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None, **kwargs: Any):
        prepare(model)  # a model the user loaded runs kvsieve's attention; a no-op for one load_model loaded
        super().__init__(model=model, tokenizer=tokenizer if tokenizer is not None else tokenizer_of(model), **kwargs)

    def __call__(self, context: str | list[str], question: str | None = None, **kwargs: Any) -> list[Any]:  # type: ignore[override]
        """Answer `question` (or each of `questions=[...]`) about `context`, or about each of a list of contexts.

        Options: `method` (a preset name or a `MethodSpec`), `set` (its fields changed as `--set` does),
        `reuse_budget` (with `questions`: keep the context compressed to this many KV entries or this fraction before
        any question), `batch_size` (contexts decoded at once), `streamer` (a transformers streamer: one context and
        one question), and the generation options `model.generate` takes
        (max_new_tokens, do_sample, temperature, top_p, top_k, repetition_penalty, min_new_tokens,
        num_return_sequences). Returns a list of answers (dicts) per context: a list of them for a list of contexts."""
        if isinstance(context, str):
            inputs: str | Contexts = context
        elif isinstance(context, list | tuple) and context and all(isinstance(c, str) for c in context):
            inputs = Contexts(tuple(context))
        else:
            raise KvsieveError("The context must be a string or a non-empty list of strings.")
        max_batch = kwargs.pop("batch_size", None)
        return cast(list[Any], super().__call__(inputs, question=question, max_batch=max_batch, **kwargs))

    def _sanitize_parameters(
        self,
        question: str | None = None,
        questions: list[str] | None = None,
        method: MethodSpec | str | None = None,
        reuse_budget: int | float | None = None,
        max_batch: int | None = None,
        streamer: BaseStreamer | None = None,
        return_full_text: bool | None = None,
        **options: Any,
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        if return_full_text:
            raise KvsieveError(
                "This pipeline returns the answer alone (text-generation's return_full_text=False): the prompt is the "
                "context and question you gave. Leave return_full_text out, or set it to False."
            )
        forward: dict[str, Any] = {} if streamer is None else {"streamer": streamer}
        if question is not None or questions is not None:
            forward["asked"] = asked(question, questions)
        if method is not None or "set" in options:
            forward["spec"] = resolve_method(method or DEFAULT_METHOD, {}).with_settings(dict(options.pop("set", {})))
        if reuse_budget is not None:
            forward["reuse_budget"] = reuse_budget
        if max_batch is not None:
            forward["max_batch"] = max_batch
        if options:
            forward["generation"] = options
        return {}, forward, {}

    def preprocess(self, input_: str | Contexts, **preprocess_parameters: Any) -> dict[str, Any]:
        return {"contexts": input_}  # the prompts are built by `generate`, as for every entry point

    def _forward(self, input_tensors: dict[str, Any], **forward_parameters: Any) -> Any:
        return self.answer(input_tensors["contexts"], **forward_parameters)

    def answer(
        self,
        contexts: str | Contexts,
        asked: str | list[str] | None = None,
        spec: MethodSpec | None = None,
        reuse_budget: int | float | None = None,
        max_batch: int = 16,
        generation: Mapping[str, Any] | None = None,
        streamer: BaseStreamer | None = None,
    ) -> dict[str, Any]:
        """Run `generate` on the contexts and the question(s) with the call's method and options."""
        if isinstance(contexts, Contexts) and isinstance(asked, list):  # `generate` would pair them, one per context
            raise KvsieveError("questions=[...] asks one context; give a list of contexts one question each, or one.")
        spec = spec if spec is not None else resolve_method(DEFAULT_METHOD, {})
        context = list(contexts.texts) if isinstance(contexts, Contexts) else contexts
        options: dict[str, Any] = {"reuse_budget": reuse_budget} if reuse_budget is not None else {}
        if streamer is not None:
            options["stream"] = streamer
        sampling = self.sampling(generation or {})
        results = generate(self.model, self.tokenizer, context, asked, method=spec, sampling=sampling,
                           max_batch=max_batch, **options)  # fmt: skip
        return {"results": results, "batch": isinstance(contexts, Contexts), "asked": asked}

    def sampling(self, options: Mapping[str, Any]) -> Sampling:
        """kvsieve's sampler from the model's generation config updated with the call's options, read as
        `model.generate(custom_generate=...)` reads them; an option the config does not know is refused by name."""
        if "max_length" in options:
            raise KvsieveError("The pipeline takes max_new_tokens (a long context's length varies), not max_length.")
        config = copy.deepcopy(self.model.generation_config)
        if "max_new_tokens" not in options:
            options = {**options, "max_new_tokens": Sampling().max_new_tokens}
        unknown = config.update(**options)
        if unknown:
            raise KvsieveError(
                f"Unknown option(s) {', '.join(sorted(unknown))}: the pipeline takes method, set, question(s), "
                "reuse_budget, batch_size and generation options (max_new_tokens, do_sample, temperature, top_p, ...)."
            )
        if config.output_scores or config.output_logits:
            raise KvsieveError(
                "The pipeline returns each answer's text and measures, not per-step scores or logits: call "
                "model.generate(..., custom_generate=kvsieve.decoding(method)) for them."
            )
        refuse_what_it_cannot_do(config)
        check_eos(self.model, self.tokenizer, config)
        return replace(sampling_of(config, 0), n=config.num_return_sequences or 1)

    def postprocess(self, model_outputs: dict[str, Any], **postprocess_parameters: Any) -> list[Any]:
        """One context and question: its answers (a list, as text-generation's); several questions: one answer each
        (a list of n where num_return_sequences asks for more); several contexts: each context's list of answers."""
        results, asked = model_outputs["results"], model_outputs["asked"]
        if isinstance(asked, list):
            per_question = [answers(result, q) for result, q in zip(results, asked, strict=True)]
            return [one[0] if len(one) == 1 else one for one in per_question]
        if model_outputs["batch"]:
            return [answers(result, asked) for result in results]
        return answers(results, asked)


def asked(question: str | None, questions: list[str] | None) -> str | list[str]:
    """The call's question, or its list of questions (not both; `generate` checks each question)."""
    if question is not None and questions is not None:
        raise KvsieveError("Give question= or questions=[...], not both.")
    if question is not None:
        return question
    if not isinstance(questions, list | tuple):
        raise KvsieveError("questions must be a list of strings; for one question use question=.")
    return list(questions)


def answers(result: GenerationResult | list[GenerationResult], question: str | None) -> list[dict[str, Any]]:
    """One context's answers (its n samples) as dicts: `generated_text` and what kvsieve measured."""
    results = result if isinstance(result, list) else [result]
    out = []
    for one in results:
        measured = one.to_dict()
        out.append({"generated_text": measured.pop("text"), "question": question, **measured})
    return out


class KvsieveModel:
    """The model class transformers' `pipeline` loads a named model with for this task: `kvsieve.load_model`."""

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, *, dtype: Any = None, gguf_file: str | None = None, **hub: Any
    ) -> PreTrainedModel:
        """Load `name_or_path` (a hub id, a folder, a folder's `gguf_file`) with kvsieve's loader; dtype "auto" is
        kvsieve's default (bfloat16 on CUDA, float32 on the CPU). Hub options (revision, token) are transformers'
        own: its config load used them, `load_model` reads the hub's environment (HF_TOKEN)."""
        source = Path(name_or_path) / gguf_file if gguf_file else name_or_path
        model, _ = load_model(source, dtype=None if dtype == "auto" else dtype)
        return model


class EmbeddedDefault(dict):
    """The task's default model, read by transformers' `pipeline` only when no model is named: the embedded SmolLM2's
    folder, converted from its wheel the first time it is read (no hub)."""

    def __contains__(self, key: object) -> bool:
        return key == "model"

    def __getitem__(self, key: str) -> tuple[str, None]:
        if key != "model":
            raise KeyError(key)
        return str(DEFAULT.folder()), None


PIPELINE_REGISTRY.register_pipeline(
    TASK, pipeline_class=KvsieveTextGenerationPipeline, pt_model=KvsieveModel, default=EmbeddedDefault(), type="text"
)
