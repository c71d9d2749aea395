"""Side by side: decode-side time from submit to first token for remotely prefilled prompts,
with our KVConnectNixl and with vLLM's own NixlConnector (kv_buffer_device="cpu"), same tiny model.

    .venv-vllm/bin/python integration/vllm/compare.py [--lengths 1000,2000,4000] [--repeats 3]

The model is a random Llama with 8 KV heads x head size 128 x 8 layers (fp32: 64 KiB of KV per
token), so the transfer matters. Prints one line per prompt length and the ratio ours / vLLM's
(goal: <= 1.0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Engine, kv_config, make_llama, prompts_of  # noqa: E402


def measure(model: Path, connector: str, lengths: list[int], repeats: int) -> dict[int, float]:
    if connector == "NixlConnector":
        kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    else:
        kv = kv_config(connector, "kv_both")
    llm = {"max_model_len": max(lengths) + 64, "max_num_batched_tokens": max(lengths) + 64}
    # vLLM's NixlConnector listens on a fixed side-channel port (5600 by default): one per engine here.
    P = Engine(model, kv=kv, core=0, name=f"compare-{connector}-prefill", llm=llm,
               env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5610"})
    D = Engine(model, kv=kv, core=1, name=f"compare-{connector}-decode", llm=llm,
               env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5620"})
    out: dict[int, float] = {}
    try:
        P.wait_ready()
        D.wait_ready()
        for n in lengths:
            times = []
            for r in range(repeats + 1):  # the first round warms up (handshake, allocations)
                prompt = prompts_of([n], seed=1000 * n + r)
                pre = P.generate(prompt, max_tokens=1, params=[{"do_remote_decode": True}])
                params = pre["outputs"][0]["kv_transfer_params"]
                dec = D.generate(prompt, max_tokens=1, params=[params])
                assert dec["outputs"][0]["finish_reason"] == "length", dec
                if r:
                    times.append(dec["wall_s"])
            out[n] = statistics.median(times)
    finally:
        P.close()
        D.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1000,2000,4000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    root = Path(args.model_dir or tempfile.mkdtemp(prefix="kvconnect-compare-"))
    model = make_llama(root / "llama-8x128x8", hidden=1024, layers=8, heads=8, kv_heads=8, head_dim=128,
                       vocab=512, intermediate=512, max_pos=max(lengths) + 128)
    ours = measure(model, "KVConnectNixl", lengths, args.repeats)
    theirs = measure(model, "NixlConnector", lengths, args.repeats)
    print(f"{'prompt':>8} {'KVConnectNixl s':>16} {'vLLM NixlConnector s':>21} {'ratio':>7}")
    for n in lengths:
        print(f"{n:>8} {ours[n]:>16.4f} {theirs[n]:>21.4f} {ours[n] / theirs[n]:>7.2f}")
    total = sum(ours.values()) / sum(theirs.values())
    print(f"overall ratio (ours / vLLM's, summed over lengths): {total:.2f}")


if __name__ == "__main__":
    main()
