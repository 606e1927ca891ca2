"""Two builds of the kernels, each in its own tree and virtual environment, alternated: step_loop.py (the served
model's 30 layers over R sequences decoding a token each, ../issue39-step-threads) for SECONDS per run, ROUNDS
rounds over the row counts; prints each run's median step.

    python bench/results/issue39-tile-padding/ab_rows.py BEFORE_PYTHON AFTER_PYTHON ROUNDS SECONDS R [R ...]
"""

import subprocess
import sys
from pathlib import Path

STEP_LOOP = Path(__file__).parent.parent / "issue39-step-threads" / "step_loop.py"


def main() -> None:
    before, after, rounds, seconds, rows = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:]
    for k in range(rounds):
        for r in rows:
            for name, python in (("before", before), ("after", after)):
                out = subprocess.run([python, str(STEP_LOOP), r, seconds], capture_output=True, text=True, check=True)
                print(f"round {k + 1} {name}: {out.stdout.strip()}", flush=True)


if __name__ == "__main__":
    main()
