"""How many of a prompt's last tokens should stand in for a question nobody marked (`kvsieve.prompt.QUESTION_WINDOW`):
IMDC on passkey prompts given as token ids (the chat template applied, no question split, as `/v1/completions` and
`model.generate` get them), each window against the unguided pruning, on the same cases.

    python benchmarks/question_window.py --length 3000 --windows 0,16,16s,32,64,128 --seeds 6

Window 0 is the unguided pruning (`feed.question_guided` off); a window alone is that many last tokens; a window
with "s" (16s, the library's rule, `kvsieve.prompt.question_tail` given the tokenizer) reaches back to the start of
its first token's sentence. Prints the keys found per window, growing per case. Quality only (the answers do not
depend on timing): it may share the machine.
"""

from __future__ import annotations

import argparse

import kvsieve.prompt as prompt_module
from kvsieve import Sampling, load_model, method, run
from kvsieve.data import passkey_case
from kvsieve.prompt import ids_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=3000, help="passkey prompt tokens (default 3000)")
    parser.add_argument("--windows", default="0,16,16s,32,64,128", help="windows; 0: unguided, s: to its sentence")
    parser.add_argument("--seeds", type=int, default=6, help="cases per depth (default 6)")
    parser.add_argument("--depths", default="0.2,0.5,0.8", help="where the key sits (default 0.2,0.5,0.8)")
    parser.add_argument("--memory", type=int, default=512, help="IMDC's memory and first chunk (default 512)")
    args = parser.parse_args()
    model, tokenizer = load_model()
    windows = args.windows.split(",")
    found: dict[str, int] = dict.fromkeys(windows, 0)
    cases = 0
    for seed in range(args.seeds):
        for depth in (float(d) for d in args.depths.split(",")):
            case = passkey_case(tokenizer, args.length, depth, seed=seed)
            messages = [{"role": "user", "content": f"{case.context}\n\n{case.question}"}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
            cases += 1
            for window in windows:
                size, sentence = int(window.removesuffix("s")), window.endswith("s")
                prompt_module.QUESTION_WINDOW = max(size, 1)
                settings = {"feed.memory": args.memory, "feed.chunk": args.memory, "feed.question_guided": size > 0}
                prompt = ids_prompt(ids["input_ids"], tokenizer=tokenizer if sentence else None)
                answer = run(model, tokenizer, prompt, method=method("imdc", settings), sampling=Sampling(12))
                found[window] += case.answer in answer.text
            print(f"seed {seed} depth {depth}: " + ", ".join(f"window {w}: {n}/{cases}" for w, n in found.items()),
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
