"""The eagle drafter's proposal of one draft, hot, and its parts called alone on one row each (medians of 300
calls, microseconds; the proposal's first step feeds two rows, the newest position again, as after a
verification): what a proposal spends besides its layer and head.

    python bench/results/issue39-program-python/draft_parts.py
"""
import statistics
import time

import torch

from edgespec.decoding import eagle
from edgespec.decoding.target_fit import SHIPPED
from edgespec.decoding.types import SamplingParams
from edgespec.model.blocks import SeqRows
from edgespec.model.config import ModelConfig
from edgespec.model.linear import weight_format
from edgespec.model.source import resolve_model
from edgespec.model.stack import TokenEnds
from edgespec.model.weights import open_source

files = resolve_model(None)
cfg, src, fmt = ModelConfig.from_folder(files.folder), open_source(files), weight_format("auto")
ends = TokenEnds.load(src, cfg, fmt)
model = eagle.FeatureDraftModel.load("eagle", SHIPPED / "smollm2-135m-instruct-eagle.safetensors", ends)
d = eagle.FeatureDrafter(model, SamplingParams(temperature=0.0), 4096)
torch.manual_seed(0)
d.observe(0, torch.randn(300, cfg.hidden_size) * 3)
tokens = torch.randint(0, 30000, (301,)).tolist()
def med(f, n=300):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return round(statistics.median(ts) * 1e6, 1)
with torch.inference_mode():
    d.propose(tokens, 1)
    def prop():
        d.fed = 298  # the newest position fed again, as after a verification (2 rows)
        d.propose(tokens, 1)
    print('propose k=1 us', med(prop))
    net = model.net
    g_prev = d.g[298:299]
    print('span', med(lambda: net.rotary.span(299, 300)))
    print('embed', med(lambda: model.ends.embed_tokens(torch.tensor([[5]]))))
    emb = model.ends.embed_tokens(torch.tensor([[5]]))
    print('cat', med(lambda: torch.cat([g_prev.unsqueeze(0), emb], dim=-1)))
    xin = torch.cat([g_prev.unsqueeze(0), emb], dim=-1)
    print('fc', med(lambda: net.fc(xin)))
    x = net.fc(xin)
    rope = net.rotary.span(299, 300)
    def lay():
        d.cache.length = 297
        model.layer(x[0], rope, [SeqRows(d.cache, 297, 1)])
    print('layer', med(lay))
    print('norm', med(lambda: model.ends.norm(x[:, -1:])))
    g = model.ends.norm(x[:, -1:])
    print('head', med(lambda: model.head(g)))
    small = model.head(g)[0, 0]
    print('argmax', med(lambda: model.ids[int(small.argmax())]))
