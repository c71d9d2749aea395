"""Does a vLLM engine agree with itself? The token after q+[g] by a decode step and by a prefill.

One engine, no connector: for each prompt length n, generate two tokens [g, h] from a prompt q of n
tokens (h comes from a decode step on top of q's prefill), then one token h' from the prompt q+[g]
(a prefill of n+1 tokens). h and h' are the same computation by vLLM's two paths. P/D of a prompt
runs the decode path for its last token, so where a model's two paths disagree, P/D tokens cannot
equal a plain run's whatever the transfer does.

    .venv-vllm/bin/python integration/vllm/prefill_vs_decode.py lfm2 granite-hybrid
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from harness import Engine, make_tiny, prompts_of

LENGTHS = (2, 3, 4, 5, 8, 17, 40, 129, 300)


def main(families: list[str]) -> None:
    """Print, per family and prompt length, whether the two paths agree."""
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            engine = Engine(make_tiny(family, Path(tmp) / family), kv=None, core="nobind", name=f"self-{family}")
            try:
                for n in LENGTHS:
                    q = prompts_of([n], seed=9)[0]
                    a = engine.generate([q], max_tokens=2, logprobs=5)["outputs"][0]
                    g, h = a["token_ids"]
                    b = engine.generate([q + [g]], max_tokens=1, logprobs=5)["outputs"][0]
                    h2 = b["token_ids"][0]
                    close = str(h) in b["logprobs"][0] and str(h2) in a["logprobs"][1]
                    verdict = "equal" if h == h2 else ("within top-5" if close else "FAR (outside top-5)")
                    print(f"{family:16s} n={n:<4d} decode step {h:<4d} prefill {h2:<4d} {verdict}", flush=True)
            finally:
                engine.close()


if __name__ == "__main__":
    main(sys.argv[1:] or ["lfm2", "granite-hybrid"])
