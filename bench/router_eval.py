"""How well the outline router (decoding/router.py) picks outline, on the labelled prompt sets:

    python -m bench.router_eval --data ../shared/data [--out FILE.json]

accuracy per set (vicuna80's categories, the WizardLM test set's skills, labelled in decoding/router.py),
the confusion counts, and the share routed to outline per category.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from edgespec.bench.prompts import prompt_text
from edgespec.decoding.router import SUITS, UNSUITED, route


def evaluate(data: Path) -> dict:
    """Accuracy of route() on the labelled prompts of vicuna80 and the WizardLM test set, per set and per
    category (share routed to outline)."""
    out = {}
    for name, field in (("vicuna80", "category"), ("wizardlm_testset", "Skill")):
        rows = [json.loads(line) for line in (data / "prompts" / f"{name}.jsonl").read_text().splitlines() if line]
        routed: dict[str, list[bool]] = {}
        for row in rows:
            routed.setdefault(row[field], []).append(route(prompt_text(row))[0])
        scored = [(cat, r) for cat, rs in routed.items() for r in rs if cat in SUITS | UNSUITED]
        correct = sum(r == (cat in SUITS) for cat, r in scored)
        confusion = Counter(f"{'suits' if cat in SUITS else 'unsuited'}->{'outline' if r else 'default'}"
                            for cat, r in scored)
        shares = {cat: round(sum(rs) / len(rs), 3) for cat, rs in sorted(routed.items())}
        out[name] = {"accuracy": round(correct / len(scored), 4), "scored": len(scored),
                     "confusion": dict(sorted(confusion.items())), "outline_share_by_category": shares}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="evaluate the outline router on the labelled prompt sets")
    p.add_argument("--data", type=Path, default=Path("../shared/data"))
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    result = evaluate(args.data)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
