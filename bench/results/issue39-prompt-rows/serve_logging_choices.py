"""`edgespec serve --port 8124` with each draft-length choice made beside 8 or more other sequences logged to
/tmp/choose.log (JSON lines: the drafter, its budget, the other sequences and their rows, the K chosen, the
acceptance by depth it weighed, the table's seconds for the plain step and the drafted one, the pass sizes measured
so far). choose_old.jsonl.gz is its log under the tree before this change, over one ngram_streams.py run.

    python bench/results/issue39-prompt-rows/serve_logging_choices.py
"""

import json
from pathlib import Path

import edgespec.decoding.draft_cost as dc
from edgespec.server.cli import main

LOG = Path("/tmp/choose.log")


def logged(choose):
    def choose_and_log(self, name, budget, besides=0, others=0):
        k = choose(self, name, budget, besides, others)
        if others >= 8:
            p, plain, drafted = self.passes, self.passes.get(besides + 1), self.passes.get(besides + 1 + k)
            with LOG.open("a") as f:
                f.write(json.dumps({
                    "name": name, "budget": budget, "besides": besides, "others": others, "k": k,
                    "rates": [round(r, 2) for r in self._by_depth(name, max(1, min(self.k_max, budget)))[:6]],
                    "judged": self.judged.get(name, [])[:4], "kept": self.kept_at.get(name, [])[:4],
                    "p0": round(plain * 1000, 2) if plain else None,
                    "pk": round(drafted * 1000, 2) if k and drafted else None,
                    "sizes": p.sizes[:40], "draft": self.drafts.get(name)}) + "\n")
        return k
    return choose_and_log


if __name__ == "__main__":
    dc.DraftLength.choose = logged(dc.DraftLength.choose)
    main(["serve", "--port", "8124"])
