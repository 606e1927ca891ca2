"""What the logged draft-length choices say (serve_logging_choices.py's logs): per log, the choices and how many
drafted, the rows drafted, and the median of the table's seconds per drafted row where 14 or more other rows were
expected beside it ((pass(besides + 1 + K) - pass(besides + 1)) / K).

    python bench/results/issue39-prompt-rows/choices.py > bench/results/issue39-prompt-rows/choices.txt
"""

import gzip
import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def main() -> None:
    for name in ("old", "new"):
        with gzip.open(HERE / f"choose_{name}.jsonl.gz", "rt") as f:
            rows = [json.loads(line) for line in f]
        drafted = [r for r in rows if r["k"]]
        per_row = [(r["pk"] - r["p0"]) / r["k"] for r in drafted if r["pk"] and r["p0"] and r["besides"] >= 14]
        print(f"{name}: {len(rows)} choices, {len(drafted)} drafted, {sum(r['k'] for r in drafted)} rows drafted; "
              f"a drafted row beside 14+ rows: median {statistics.median(per_row) * 1000:.0f} us over {len(per_row)}")
        example = next((r for r in drafted if r["besides"] == 15), None)
        if example:
            print(f"  e.g. {json.dumps(example)}")


if __name__ == "__main__":
    main()
