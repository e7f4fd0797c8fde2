"""What pinning the CPU kernels to AVX2 costs (`mmcse.cpu_isa`): a student's training step, forward, backward and
AdamW update, timed with the kernels pinned and with each library left to its own choice (``MMCSE_CPU_ISA=native``),
each in its own process (the instruction set is fixed when a library starts), and the ratio.

    python benchmarks/cpu_isa.py                       # a BERT-base-shaped student, B 16 × 32, fp32
    python benchmarks/cpu_isa.py --layers 2 --hidden 128 --steps 5

On an AVX2-only CPU both runs take the same kernels (ratio ~1: the pin changes nothing there); on an AVX-512 CPU the
ratio is what the same bytes cost. Prints the CPU's vector flags and torch's capability for each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from mmcse.cpu_isa import cpu_flags

STEP = """
import json, sys, time
import torch
from transformers import BertConfig, BertModel
layers, hidden, batch, length, steps = (int(a) for a in sys.argv[1:6])
torch.manual_seed(0)
torch.set_num_threads(int(sys.argv[6]))
model = BertModel(BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 2),
                             intermediate_size=4 * hidden), add_pooling_layer=False)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
ids = torch.randint(1000, 2000, (2 * batch, length))
def step():
    out = model(ids).last_hidden_state[:, 0]
    z1, z2 = torch.nn.functional.normalize(out[:batch], dim=-1), torch.nn.functional.normalize(out[batch:], dim=-1)
    loss = torch.nn.functional.cross_entropy(z1 @ z2.T / 0.05, torch.arange(batch))
    optimizer.zero_grad(); loss.backward(); optimizer.step()
step()  # warm-up
times = []
for _ in range(steps):
    started = time.perf_counter(); step(); times.append(time.perf_counter() - started)
times.sort()
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "median_s": times[len(times) // 2]}))
"""


def vector_flags() -> list[str]:
    return sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "amx")))


def timed(isa: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "MMCSE_CPU_ISA": isa}
    code = "import mmcse\n" + STEP  # mmcse's import pins (or, with native, leaves) the kernels before torch loads
    done = subprocess.run([sys.executable, "-c", code, str(args.layers), str(args.hidden), str(args.batch),
                           str(args.length), str(args.steps), str(args.threads)], env=env, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=max(os.cpu_count() or 1, 1))
    args = parser.parse_args(argv)
    print(f"device: cpu ({os.cpu_count()} cores; vector flags: {' '.join(vector_flags()) or 'unknown'})")
    native, pinned = timed("native", args), timed("avx2", args)
    print(f"step (BERT {args.layers} layers × {args.hidden}, B {args.batch} × {args.length}, fp32, "
          f"{args.threads} threads): native {native['capability']} {1000 * native['median_s']:.0f} ms, "
          f"pinned {pinned['capability']} {1000 * pinned['median_s']:.0f} ms, "
          f"ratio pinned / native {pinned['median_s'] / native['median_s']:.2f}")


if __name__ == "__main__":
    main()
