"""The model thread's py-spy samples (spy_under_load.sh's raw files, gzipped here) by what they were in: the
layers' compiled call, the head, the executor's other work, idle (waiting for work), the programs, and the rest.

    cd bench/results/issue39-ceilings/default16 && python spy_summary.py > spy_summary.txt
"""

import collections
import gzip
import re
from pathlib import Path

HERE = Path(__file__).parent


def bucket(stack: str) -> str:
    leaf = stack.split(";")[-1]
    if "CompiledLayers.__call__" in stack:
        return "layers"
    if "TokenEnds.logits" in stack:
        return "head"
    if "_worker (concurrent" in leaf or "thread.py" in leaf:
        return "idle"
    if any(p in stack for p in ("program", "Program", "speculative.py", "naive.py", "eagle.py", "drafters.py")):
        return "programs"
    if "executor.py" in stack:
        return "executor (other)"
    return "other: " + re.sub(r"\(/work/main/", "(", leaf)[:70]


def main() -> None:
    for name in ("naive16", "speculative16"):
        counts, total = collections.Counter(), 0
        with gzip.open(HERE / f"spy_{name}.txt.gz", "rt") as f:
            for line in f:
                stack, _, n = line.rstrip().rpartition(" ")
                if "model_0" in stack.split(";")[0]:
                    counts[bucket(stack)] += int(n)
                    total += int(n)
        print(f"{name}: {total} samples of the model thread")
        for key, n in counts.most_common(6):
            print(f"  {n / total:6.1%} {key}")


if __name__ == "__main__":
    main()
