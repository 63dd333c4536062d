"""A real generation run on the default model: chat prompts, greedy and sampled, then a
throughput line. `make demo` runs this."""

from __future__ import annotations

import argparse
import time

from jaxpipe import Engine, EngineConfig, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the ocean.",
    "Explain what a CPU cache is in two sentences.",
    "What is 17 times 23?",
    "Name three planets in our solar system.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=512,
                                 max_num_seqs=16))
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    runs = [("greedy", SamplingParams(temperature=0.0, max_tokens=args.max_tokens)),
            ("sampled (T=0.7, top_p=0.9, seed=1)",
             SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=args.max_tokens))]
    generated, elapsed = 0, 0.0
    for label, params in runs:
        start = time.perf_counter()
        outputs = engine.chat(conversations, params)
        elapsed += time.perf_counter() - start
        print(f"\n===== {label} =====")
        for question, out in zip(QUESTIONS, outputs, strict=True):
            completion = out.outputs[0]
            generated += len(completion.token_ids)
            print(f"\n> {question}\n{completion.text.strip()}\n"
                  f"  [{len(completion.token_ids)} tokens, finish: {completion.finish_reason}]")
    stats = engine.stats()
    print(f"\nthroughput: {generated} tokens in {elapsed:.1f} s = {generated / elapsed:.1f} "
          f"output tok/s over {2 * len(QUESTIONS)} requests ({args.dtype}, batch of "
          f"{len(QUESTIONS)}; compile {stats['compile_seconds']:.1f} s excluded)")


if __name__ == "__main__":
    main()
