"""The cpu target's time for one small batch at each thread count, beside the machine's load.

    python bench/cpu_threads.py --threads 1 2 --repeat 3

Each thread count runs in a process of its own with OMP_NUM_THREADS set to it (which the cpu target then keeps):
the embedded model, 4 prompts of 16 greedy tokens, after one warm-up batch.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

RUN = """
import sys, time
from deepinfer import LLM, SamplingParams
llm = LLM()
params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
llm.generate(["def fib(n):"] * 4, params, use_tqdm=False)
for _ in range(int(sys.argv[2])):
    start = time.perf_counter()
    llm.generate(["def fib(n):"] * 4, params, use_tqdm=False)
    print(f"{time.perf_counter() - start:.2f}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    for threads in args.threads:
        load = os.getloadavg()[0]
        run = subprocess.run([sys.executable, "-c", RUN, str(threads), str(args.repeat)], capture_output=True,
                             text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        print(f"threads {threads}: load {load:.1f} before, seconds per batch {' '.join(run.stdout.split())}")


if __name__ == "__main__":
    main()
