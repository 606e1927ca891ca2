"""`edgespec` command line: serve, worker, profile, plan, bench, bench-peer, eval-formats, ...

The benchmarks (bench/) and the offline training tools (decoding/training/) are imported only inside the
functions of their own commands, so that `serve` and `worker` never load them (tests/test_layout.py). bench/ is
not installed with the package: its commands run from a checkout of the repository.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from edgespec.planning.cli import add_plan_parser

# model/linear.py's weight formats (the CLI parses arguments without importing torch)
FORMATS = ["auto", "q4_1", "q8_0", "float32", "bfloat16", "float16"]


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model through the OpenAI-compatible API")
    p.add_argument("--model", help="Hugging Face folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key", action="append", help="require 'Authorization: Bearer KEY' on /v1 routes; repeat "
                   "the flag or separate keys by commas to accept several")
    p.add_argument("--api-key-file", help="a file of accepted API keys, one per line (blank lines and # comments "
                   "skipped); read at start, together with any --api-key")
    p.add_argument("--max-request-bytes", type=int, help="largest /v1 request body (default 4 MiB; more: 413)")
    p.add_argument("--max-header-bytes", type=int, help="largest request line and headers (default 32 KiB; more: 431)")
    p.add_argument("--policy", help="default decoding policy")
    p.add_argument("--weights", "--dtype", dest="dtype", choices=FORMATS,
                   help="weight format (default auto: a GGUF's own quantization, float32 for a folder)")
    p.add_argument("--threads", type=int)
    p.add_argument("--kv-cache-gib", type=float, help="memory bound of all sessions' KV caches (default 2)")
    p.add_argument("--kv-format", help="how the KV cache stores keys and values, here and on the workers: float16 "
                   "(the default), float32 or q8_0 (README, 'KV cache formats')")
    p.add_argument("--kv-prefault", action="store_true", default=None, help="commit the KV caches' memory at load "
                   "(here and on local workers), so that RSS holds still while serving")
    p.add_argument("--max-waiting", type=int, help="requests that may wait for KV cache room (default 64; more: 503)")
    p.add_argument("--queue-timeout-s", type=float, help="how long a request may wait for KV cache room (default 60)")
    p.add_argument("--tool-call-threshold", type=float, help="tool_choice auto: call when log P(the call opening) "
                   "reaches this (default -7)")
    p.add_argument("--ollama-options", type=json.loads, help="the Ollama API's options for requests that leave "
                   "them unset, as JSON (what a Modelfile's PARAMETER lines set), e.g. '{\"temperature\": 0}'")
    p.add_argument("--log-level")
    p.add_argument("--local-workers", type=int, help="start N worker processes on loopback and serve through them")
    p.add_argument("--cluster", help="TOML file naming running workers (see config/cluster.example.toml)")
    p.add_argument("--discover", action="store_true", default=None, help="find workers on the LAN by mDNS/DNS-SD "
                   "and adopt those that prove the cluster token (instead of --cluster)")
    p.add_argument("--cluster-token", help="the cluster's shared token, for --discover (better: the environment "
                   "variable EDGESPEC_CLUSTER_TOKEN, which other users cannot read in the process list)")
    p.add_argument("--discover-workers", type=int, help="with --discover: workers to wait for at start (default 1)")
    p.add_argument("--discover-wait-s", type=float, help="with --discover: how long to wait for them (default 30); "
                   "then serve with those found, or in-process until one is found")
    p.add_argument("--worker-threads", type=int, help="torch threads of each local worker (0: all cores)")
    p.add_argument("--worker-memory-budget-gib", type=float, help="each local worker's bound for its weights plus KV "
                   "caches (default 4): a model bigger than one worker is split over several")
    p.add_argument("--stage-timeout-s", type=float, help="timeout of one call to a worker (default 60)")
    p.add_argument("--recover-probe-s", type=float, help="after a failed call, a worker that does not answer "
                   "within this many seconds is planned out (default 5)")
    p.add_argument("--restart-wait-s", type=float, help="when no placement fits the workers left after a loss, how "
                   "long work waits for a lost local worker to be started again and planned back in (default 180)")
    p.add_argument("--worker-cpus", help="CPU sets of the local workers, e.g. '0;1'")
    p.add_argument("--placement", choices=["plan", "even"], help="layers by the planner (default) or evenly")
    p.add_argument("--profile", help="profile JSON to plan from (default: cached, or measured at start)")
    p.add_argument("--reprofile", action="store_true", default=None, help="measure a new profile")
    p.add_argument("--profile-tag", help="a label that keeps cached profiles measured under other conditions apart")
    p.add_argument("--plan-context", type=int, help="KV slots per session the placement must hold")
    p.add_argument("--plan-concurrency", type=int, help="sessions at once the placement must hold")
    p.add_argument("--memory-threshold", type=float, help="re-plan when a worker's memory use passes this share")
    p.add_argument("--monitor-interval-s", type=float, help="how often the controller checks its workers")
    p.add_argument("--pipelined-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="pipeline long prompts through the workers in segments (default: on)")
    p.add_argument("--prefill-segment", type=int, help="fixed prefill segment length (overrides the plan)")
    p.add_argument("--prefix-cache-mib", type=float, help="KV kept for prefix reuse (0: off; default 256)")
    p.add_argument("--prefix-min-tokens", type=int, help="shortest shared prefix worth reusing (default 32)")
    p.add_argument("--draft-model", action="append", dest="draft_models",
                   help="a drafter for `speculative`: PATH or NAME=PATH sharing the tokenizer (repeatable)")
    p.add_argument("--layerskip", help="offer the `layerskip` self-draft keeping these layers, e.g. '0-11,28-29'")
    p.add_argument("--draft-k", type=int,
                   help="speculative draft length before a pass was timed (default 4; then chosen by cost)")
    p.add_argument("--draft-k-min", type=int,
                   help="shortest chosen draft length (default 0: a plain step where drafting does not pay)")
    p.add_argument("--draft-k-max", type=int, help="longest chosen draft length (default 8)")
    p.add_argument("--eagle", help="trained feature drafter `eagle`: a file from train-drafter, 'auto' (default: "
                                   "the shipped one, when trained for the served model) or 'off'")
    p.add_argument("--medusa", help="Medusa heads for the `medusa` policy: a file from train-medusa, 'auto' (default: "
                   "the shipped heads when they fit the model) or 'off'")
    p.add_argument("--headsplit", action=argparse.BooleanOptionalAction, default=None,
                   help="offer the `headsplit` policy (default: on; its blocks load at its first request)")
    p.add_argument("--headsplit-epsilon", type=float, help="`headsplit`'s default tolerance (default 0.05)")
    p.add_argument("--headsplit-profile", help="HeadSplit profile JSON (default: the shipped one for the model)")
    p.add_argument("--speculative-drafter", help="drafter of the plain `speculative` policy (default: eagle+ngram "
                                                 "when eagle is loaded, else the first draft model's, else ngram)")


def _profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure the controller, the workers and their links for the planner")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--local-workers", type=int, help="start N worker processes on loopback and profile them")
    where.add_argument("--cluster", help="TOML file naming running workers")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--model", help="Hugging Face folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--weights", "--dtype", dest="dtype", default="auto", choices=FORMATS)
    p.add_argument("--worker-cpus", help="CPU sets of the local workers, e.g. '0;1'")
    p.add_argument("--worker-threads", type=int, default=0)
    p.add_argument("--worker-memory-budget-gib", type=float, help="each local worker's memory budget (as serve's)")
    p.add_argument("--kv-format", default="float16", help="the KV cache format the card counts (as serve's)")
    p.add_argument("--tokens", help="comma-separated tokens-per-pass points (default 1,2,4,...,512)")
    p.add_argument("--contexts", help="comma-separated context lengths (default 0,512,2048)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per point (median)")
    p.add_argument("--margin", type=float, default=0.15, help="safety margin on link times")


def _worker_parser(sub) -> None:
    p = sub.add_parser("worker", help="serve a share of the model's layers to a controller")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token", required=True, help="the cluster's shared token")
    p.add_argument("--host")
    p.add_argument("--name")
    p.add_argument("--memory-budget-gib", type=float)
    p.add_argument("--kv-prefault", action="store_true", default=None,
                   help="commit the KV cache's memory when layers are assigned")
    p.add_argument("--model", help="local copy of the model (folder or .gguf); default: the embedded one")
    p.add_argument("--threads", type=int)
    p.add_argument("--adapt-threads", action=argparse.BooleanOptionalAction, default=None,
                   help="run fewer torch threads while other processes take cores (default: on)")
    p.add_argument("--tool-call-threshold", type=float, help="tool_choice auto: call when log P(the call opening) "
                   "reaches this (default -7)")
    p.add_argument("--log-level")
    p.add_argument("--join", help="controller URL to announce this worker to at start-up")
    p.add_argument("--advertise-url", help="URL at which the controller reaches this worker (with --join)")
    p.add_argument("--announce", action=argparse.BooleanOptionalAction, default=None,
                   help="announce this worker on the LAN (mDNS/DNS-SD, never the token) for `serve --discover` "
                   "(default: on when --host is not a loopback address)")
    p.add_argument("--announce-address", action="append", help="IPv4 address to announce (repeatable; default: "
                   "the --host address, or the host's LAN addresses with --host 0.0.0.0)")
    p.add_argument("--max-header-bytes", type=int, help="largest request line and headers (default 32 KiB; more: 431)")
    p.add_argument("--max-body-bytes", type=int, help="largest request body (default 64 MiB; more: 413)")


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure decoding policies through a running server's streaming API")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--prompts", required=True, help="JSONL file (fields turns, Instruction, instruction or prompt)")
    p.add_argument("--policies", default="naive",
                   help="comma-separated policy names; POLICY:DRAFTER picks a drafter, e.g. speculative:ngram")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, help="use the first N prompts only")
    p.add_argument("--api-key")
    p.add_argument("--transformers-baseline", action="store_true",
                   help="also time transformers' generate on the same prompts (same model and dtype, this process)")
    p.add_argument("--model", help="model for the transformers baseline (default: the embedded one)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--out", required=True, help="folder for results.json and plots")


def _eval_formats_parser(sub) -> None:
    p = sub.add_parser("eval-formats", help="held-out perplexity of each weight format against float32")
    p.add_argument("--model", help="Hugging Face folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--formats", default="auto,q4_1,q8_0,bfloat16,float32", help="comma-separated weight formats")
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/prompts/"
                                         "alpaca_seed_tasks.jsonl"), help="self-instruct seed tasks (JSONL)")
    p.add_argument("--tasks", type=int, default=40, help="the last N tasks are the held-out text")
    p.add_argument("--out", required=True)


def _bench_peer_parser(sub) -> None:
    p = sub.add_parser("bench-peer", help="edgespec against llama.cpp's server on the same GGUF, prompts in turn")
    p.add_argument("--prompts", required=True, help="JSONL file (fields turns, Instruction, instruction or prompt)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, help="use the first N prompts only")
    p.add_argument("--formats", default="auto",
                   help="comma-separated edgespec weight formats, each passed as `serve --weights FORMAT` "
                        "('default': no --weights)")
    p.add_argument("--policies", default="naive,speculative", help="comma-separated edgespec policies")
    p.add_argument("--edgespec-args", default="",
                   help="more `edgespec serve` arguments, one string: --edgespec-args='--threads 2'")
    p.add_argument("--llama-python", help="llama-cpp-python's interpreter (default: $EDGESPEC_LLAMA_PYTHON, "
                                          "else /root/llamacpp-venv/bin/python, made by `make peer-env`)")
    p.add_argument("--llama-threads", type=int, default=2, help="llama.cpp's --n_threads")
    p.add_argument("--llama-ctx", type=int, default=2048, help="llama.cpp's --n_ctx")
    p.add_argument("--model", help="a GGUF file both servers serve, or a folder whose weights are one (a scale "
                   "model's; edgespec reads its tokenizer there) (default: the embedded default model's)")
    p.add_argument("--ready-timeout-s", type=float, default=600, help="how long a server may take to start")
    p.add_argument("--long-prompt-tokens", type=int, default=1024,
                   help="then time one-token answers to prompts of about this many tokens (0: do not)")
    p.add_argument("--long-prompt-repeats", type=int, default=5, help="long prompts per server, in turn")
    p.add_argument("--out", required=True, help="folder for versus.json, versus.png and the servers' logs")


def _distill_arguments(p: argparse.ArgumentParser) -> None:
    """The self-distillation data shared by train-drafter and train-medusa (one cache under --work)."""
    p.add_argument("--model", default=None, help="the target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--data", type=Path, default=Path("../shared/data"), help="the shared data folder")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "edgespec" / "distill",
                   help="where generated answers and features are cached")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--samples", type=int, default=2, help="sampled answers per prompt besides the greedy one")
    p.add_argument("--temperature", type=float, default=0.7, help="of the sampled answers")
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--vocab", type=int, default=8192, help="ids the trained head may propose")
    p.add_argument("--holdout", type=float, default=0.1, help="share of prompts held out for evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="torch device for generating the answers and their features "
                   "and for training the drafter (e.g. cuda); the held-out replay runs on the CPU, as serving does")


def _train_parsers(sub) -> None:
    p = sub.add_parser("train-drafter", help="distil a feature drafter for `speculative` from the model's answers")
    _distill_arguments(p)
    p.add_argument("--out", type=Path, help="the weights file (default: the shipped drafter's, in decoding/trained)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--cls-weight", type=float, default=1.0, help="weight of the token loss beside the feature loss")
    p.add_argument("--noise", type=float, default=0.05, help="uniform noise on input features, in units of their RMS")
    p.add_argument("--unroll", type=int, default=2, help="passes on the drafter's own predicted features")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--k", type=int, default=4, help="draft length of the evaluation")
    p = sub.add_parser("train-medusa", help="train Medusa heads for `medusa` on the model's own answers")
    _distill_arguments(p)
    p.add_argument("--out", type=Path, help="the heads file (default: the shipped one, in decoding/trained)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--decay", type=float, default=0.8, help="head k's loss weight is decay**k")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-nodes", type=int, default=40, help="largest candidate tree considered")
    p.add_argument("--retree", action="store_true", help="keep the trained heads in --out: only measure this "
                   "machine's verification cost again and choose the default tree")


def _headsplit_parser(sub) -> None:
    p = sub.add_parser("profile-headsplit", help="HeadSplit's offline profile: per-layer speculation acceptance "
                       "and block times")
    p.add_argument("--model", default=None, help="the model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--data", type=Path, default=Path("../shared/data"), help="the shared data folder")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "edgespec" / "distill",
                   help="where generated answers are cached (shared with train-drafter)")
    p.add_argument("--prompts", type=int, default=64, help="calibration prompts (their greedy answers too)")
    p.add_argument("--heldout", type=int, default=32, help="the next prompts, whose answers' perplexity is measured")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--epsilon", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3])
    p.add_argument("--contexts", type=int, nargs="+", default=[0, 1024], help="cached tokens of the timed passes")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="of the timed blocks")
    p.add_argument("--out", type=Path, help="the profile (default: config/profiles/MODEL-headsplit.json)")
    p = sub.add_parser("compare-headsplit", help="layer-based, head-level and HeadSplit decoding of one prompt over "
                       "pinned local workers: per-token latency, payload, speculation counts (the paper's --mode all)")
    p.add_argument("--out", type=Path, required=True, help="where headsplit.json and headsplit.png go")
    p.add_argument("--model", help="a model folder or .gguf, or a scale-model shape (e.g. tinyllama-1.1b: written "
                   "once in bfloat16 by synth-model) (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens decoded per mode")
    p.add_argument("--workers", default="2", help="worker counts, comma-separated (e.g. 2,3,4,5), each in turn; "
                   "pinned one per core where there are cores enough")
    p.add_argument("--link", help="put the controller and each worker in network namespaces on links shaped as "
                   "this link of config/devices.toml (e.g. wifi) (default: loopback)")
    p.add_argument("--rate", help="shaped links' tc rate, e.g. 100mbit (overrides --link's)")
    p.add_argument("--delay-ms", type=float, help="netem delay on each shaped egress (default: --link's round "
                   "trip / 4, a round trip crossing four)")
    p.add_argument("--layer-placement", choices=["even", "plan"], default="even",
                   help="layer-based: even layer ranges over every worker (as the paper's baseline) or the planner's")
    p.add_argument("--epsilon", type=float, nargs="+", default=[0.05, 0.3], help="HeadSplit's tolerances")
    p.add_argument("--mode", choices=["layer", "head", "headsplit", "all"], default="all")
    p.add_argument("--data", type=Path, default=Path("../shared/data"), help="the shared data folder")
    p.add_argument("--no-perplexity", dest="perplexity", action="store_false",
                   help="skip the held-out perplexity of the HeadSplit modes")


def _synth_parser(sub) -> None:
    p = sub.add_parser("synth-model", help="write a scale model: a real model's shape with seeded random weights "
                       "(its text is noise: it is for speed, memory and placement)")
    p.add_argument("--shape", required=True, help="a card of config/models with Hugging Face fields (e.g. "
                   "tinyllama-1.1b, llama-2-7b, qwen3-4b, qwen3-moe-7b-a1b; an unknown name lists them all) or a "
                   "card JSON's path")
    p.add_argument("--out", type=Path, help="the folder to write (default: in the cache, by shape, format and seed)")
    p.add_argument("--weights", default="q4_1", choices=FORMATS[1:],
                   help="q4_1 / q8_0: a GGUF of those blocks; float32 / bfloat16 / float16: safetensors (default q4_1)")
    p.add_argument("--seed", type=int, default=0, help="the same seed writes the same bytes (default 0)")


def _overrides(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if v is not None and k != "command"}


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from edgespec.decoding.policy import build_policies
    from edgespec.model.allocator import tune_malloc
    from edgespec.server.app import create_app
    from edgespec.server.boot import load_draft_models, load_medusa, load_served_model
    from edgespec.server.http_limits import uvicorn_http_options
    from edgespec.server.metrics import Metrics
    from edgespec.server.service import CompletionService

    settings = serve_settings(args)
    tune_malloc()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    metrics = Metrics()
    loaded, engine, cluster = load_served_model(settings, metrics)
    drafts = load_draft_models(settings, loaded)
    medusa = load_medusa(settings, loaded)

    def shutdown() -> None:
        # From the app's lifespan: uvicorn re-raises SIGTERM after its shutdown, so code after run() may not run.
        engine.close()
        if cluster is not None:
            cluster.config.stop()

    try:
        draft_k = (settings.draft_k, settings.draft_k_min, settings.draft_k_max)
        policies = build_policies(drafts, settings.speculative_drafter, draft_k, medusa, settings.policy,
                                  settings.headsplit, settings.headsplit_epsilon)
        service = CompletionService(loaded, engine, policies, settings, metrics, cluster)
        # What is loaded stays: out of the collector's way. A full collection walked the default server's ~370k
        # objects in 161-166 ms holding the GIL, a stall of every stream whenever one ran; frozen, 0.0 ms.
        gc.collect()
        gc.freeze()
        uvicorn.run(create_app(service, shutdown), host=settings.host, port=settings.port,
                    log_level=settings.log_level, **uvicorn_http_options(settings.max_header_bytes))
    finally:
        shutdown()


def worker(args: argparse.Namespace) -> None:
    import uvicorn

    from edgespec.model.allocator import tune_malloc
    from edgespec.server.http_limits import uvicorn_http_options
    from edgespec.workers.app import create_worker_app
    from edgespec.workers.frames import MAX_HEADER
    from edgespec.workers.settings import WorkerSettings

    settings = WorkerSettings(**_overrides(args))
    tune_malloc()
    app = create_worker_app(settings)
    # links carry framed messages as large as a body may be; no keepalive pings: a worker computing a long
    # prefill does not answer one in time, and a lost peer shows on the next send (or the step's timeout)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                ws_max_size=settings.max_body_bytes + MAX_HEADER + 4, ws_ping_interval=None, ws_ping_timeout=None,
                **uvicorn_http_options(settings.max_header_bytes))


def profile(args: argparse.Namespace) -> None:
    from edgespec.workers.profile_cli import run_profile

    run_profile(args)


def plan(args: argparse.Namespace) -> None:
    from edgespec.planning.cli import run_plan

    sys.exit(run_plan(args))


@contextmanager
def _from_checkout(command: str) -> Iterator[None]:
    """Around a benchmark's import: bench/ ships with a checkout of the repository, not with the installed
    package, so where it is missing the command says where to run it instead of a traceback."""
    try:
        yield
    except ModuleNotFoundError as exc:
        if exc.name != "edgespec.bench":
            raise
        print(f"edgespec {command}: the benchmarks (bench/) are not installed with edgespec; run this command from "
              "a checkout of its repository, in its test environment (`make install-test`, then "
              f"`.venv/bin/edgespec {command} ...`)", file=sys.stderr)
        sys.exit(2)


def bench(args: argparse.Namespace) -> None:
    with _from_checkout(args.command):
        from edgespec.bench.run import run_bench

    run_bench(args)


def eval_formats(args: argparse.Namespace) -> None:
    with _from_checkout(args.command):
        from edgespec.bench.formats import run

    run(args)


def bench_peer(args: argparse.Namespace) -> None:
    with _from_checkout(args.command):
        from edgespec.bench.versus import run_versus

    run_versus(args)


def train_drafter(args: argparse.Namespace) -> None:
    from edgespec.decoding.training.train_drafter import train

    train(args)


def train_medusa(args: argparse.Namespace) -> None:
    from edgespec.decoding.training.train_medusa import train

    train(args)


def profile_headsplit(args: argparse.Namespace) -> None:
    from edgespec.decoding.training.profile_headsplit import profile

    profile(args)


def compare_headsplit(args: argparse.Namespace) -> None:
    with _from_checkout(args.command):
        from edgespec.bench.headsplit import run

    run(args)


def synth_model(args: argparse.Namespace) -> None:
    from edgespec.model.synth import synthesize

    print(synthesize(args.shape, args.out, args.weights, args.seed))


def build_parser() -> argparse.ArgumentParser:
    """The `edgespec` command line: one subcommand per tool."""
    parser = argparse.ArgumentParser(prog="edgespec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _worker_parser(sub)
    _profile_parser(sub)
    add_plan_parser(sub)
    _bench_parser(sub)
    _bench_peer_parser(sub)
    _eval_formats_parser(sub)
    _train_parsers(sub)
    _headsplit_parser(sub)
    _synth_parser(sub)
    return parser


def serve_settings(args: argparse.Namespace):
    """The ServeSettings of parsed `serve` arguments (over EDGESPEC_* environment variables)."""
    from edgespec.server.settings import ServeSettings

    return ServeSettings(**_overrides(args))


# libgomp (torch's OpenMP) spins 300000 rounds of `pause` after every parallel region before its threads sleep:
# several ms here, while the kernels' own pool (model/kernels/pool.cpp) needs the same two cores. Once a drafter's
# or a sampler's torch ops had started the team, the default model's decode fell to 0.73-0.92x and a 1016-token
# prompt's first token took 2.7-3.1 s instead of 2.1-2.3 (same server, before and after three speculative
# requests). 20000 rounds (a fifteenth of the default) kept that speed, and bfloat16's oneDNN matmuls, whose
# regions follow each other closely, kept theirs (29.6/29.8 against 32.9/27.5 tok/s, alternated);
# OMP_WAIT_POLICY=PASSIVE did not (16.9/16.5 against 30.2/25.2). libgomp reads it when torch is first imported,
# which happens after this.
GOMP_SPINCOUNT = "20000"


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)  # a user's own setting wins
    try:
        commands = {"serve": serve, "worker": worker, "profile": profile, "plan": plan, "bench": bench,
                    "bench-peer": bench_peer, "eval-formats": eval_formats,
                    "train-drafter": train_drafter, "train-medusa": train_medusa,
                    "profile-headsplit": profile_headsplit, "compare-headsplit": compare_headsplit,
                    "synth-model": synth_model}
        commands[args.command](args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"edgespec {args.command}: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
