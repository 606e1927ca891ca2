"""`edgespec plan`: place a profiled model's layers on its devices and show the predictions.

server/cli.py adds the subcommand with add_plan_parser(sub) and runs it with run_plan(args).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from edgespec.planning.plan import InfeasibleError, PlanOptions, make_plan
from edgespec.planning.profile import ClusterProfile
from edgespec.planning.report import even_baseline, plan_summary, plan_table, plot_plan


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Add `plan` to an argparse subparsers object; returns its parser."""
    defaults = PlanOptions()
    p = subparsers.add_parser("plan", help="place layers on profiled devices and predict latency")
    p.add_argument("--profile", required=True, help="ClusterProfile JSON (edgespec profile, or planning.testbeds)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    p.add_argument("--png", help="also draw the plan to this PNG file")
    p.add_argument("--context", type=int, default=defaults.context,
                   help=f"KV slots per session every stage must hold (default {defaults.context})")
    p.add_argument("--concurrency", type=int, default=defaults.concurrency,
                   help=f"sessions at once (default {defaults.concurrency})")
    p.add_argument("--tokens", type=int, default=defaults.tokens,
                   help=f"tokens per pass the layer split balances (default {defaults.tokens}: decoding)")
    p.add_argument("--compare-even", action=argparse.BooleanOptionalAction, default=True,
                   help="also predict the even split (default: yes)")
    return p


def run_plan(args: argparse.Namespace) -> int:
    """Plan and print; 0 on success, 2 when the profile is unreadable or no placement fits."""
    try:
        profile = ClusterProfile.load(Path(args.profile))
    except (OSError, ValueError) as exc:
        print(f"edgespec plan: {exc}", file=sys.stderr)
        return 2
    options = PlanOptions(context=args.context, concurrency=args.concurrency, tokens=args.tokens)
    try:
        plan = make_plan(profile, options)
    except InfeasibleError as exc:
        print(f"edgespec plan: {exc}", file=sys.stderr)
        return 2
    even, note = even_baseline(profile, options) if args.compare_even else (None, "")
    if args.json:
        print(json.dumps(plan_summary(plan, even, note), indent=1))
    else:
        from rich.console import Console

        Console().print(plan_table(plan, even, note))
    if args.png:
        plot_plan(plan, args.png, even)
        print(f"edgespec plan: wrote {args.png}", file=sys.stderr)  # stderr: stdout may be JSON
    return 0
