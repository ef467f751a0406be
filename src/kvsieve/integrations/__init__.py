"""kvsieve where transformers users already are: each file is one place transformers calls into kvsieve.

    generation_config.py  transformers' GenerationConfig read as kvsieve's Sampling (what applies, what is refused)
    custom_generate.py    `model.generate(..., custom_generate=kvsieve.decoding(method))`
    pipeline_task.py      `pipeline("kvsieve-text-generation")`, registered when kvsieve is imported

All of them run the engine's `kvsieve.run`, as the CLI and the server do.
"""
