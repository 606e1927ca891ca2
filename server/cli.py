"""`edgespec` command line: serve, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model through the OpenAI-compatible API")
    p.add_argument("--model", help="Hugging Face folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key")
    p.add_argument("--policy", help="default decoding policy")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int)
    p.add_argument("--kv-cache-gib", type=float)
    p.add_argument("--log-level")


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure decoding policies through a running server's streaming API")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--prompts", required=True, help="JSONL file (fields turns, Instruction, instruction or prompt)")
    p.add_argument("--policies", default="naive", help="comma-separated policy names")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, help="use the first N prompts only")
    p.add_argument("--api-key")
    p.add_argument("--transformers-baseline", action="store_true",
                   help="also time transformers' generate on the same prompts (same model and dtype, this process)")
    p.add_argument("--model", help="model for the transformers baseline (default: the embedded one)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--out", required=True, help="folder for results.json and plots")


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from decoding.policy import build_policies
    from model.load import load_local
    from model.source import resolve_model
    from server.app import create_app
    from server.metrics import Metrics
    from server.service import CompletionService
    from server.settings import ServeSettings

    overrides = {k: v for k, v in vars(args).items() if v is not None and k not in ("command", "func")}
    settings = ServeSettings(**overrides)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threads = settings.threads or os.cpu_count() or 1
    loaded = load_local(resolve_model(settings.model), settings.dtype, settings.kv_cache_gib, threads)
    service = CompletionService(loaded, build_policies(), settings, Metrics())
    app = create_app(service)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)


def bench(args: argparse.Namespace) -> None:
    from bench.run import run_bench

    run_bench(args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="edgespec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _bench_parser(sub)
    args = parser.parse_args(argv)
    try:
        {"serve": serve, "bench": bench}[args.command](args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"edgespec {args.command}: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
