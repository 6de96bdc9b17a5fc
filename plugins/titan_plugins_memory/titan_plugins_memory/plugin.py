"""Hook implementations of the memory plugin (no torch import here: ``titan plugins list``).

- the ``memory_report`` callback: on under the fake comm backends and with
  ``debug.memory_report``; the folder keeps no earlier run's report (``outputs.py``);
- ``titan run ... --all-pp-ranks``: the pure fake run of every pipeline coordinate;
- ``titan memory view SNAPSHOT [-o OUT.html]`` and ``titan memory compare A.json B.json``;
- ``titan compare RUN_DIR...``: per-step losses and gradient norms of several runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from titan_core import Callback, Command, RunOption, hookimpl
from titan_plugins_memory.outputs import REPORT_PATTERN, SWEEP_LOGS, SWEEP_SUMMARY


def _build_report(trainer: Any) -> Any:
    """The report of this run, or ``None``; either way the folder keeps no earlier run's report."""
    from titan_plugins_memory.outputs import clear_reports
    from titan_plugins_memory.report import MemoryReport, run_layout

    config = trainer.config
    on = config.debug.memory_report  # the fake backends set it (CommBackend.sets)
    # Called in every run, so that one without the report does not leave an earlier run's.
    clear_reports(config.job.dump_folder, run_layout(trainer) if on else None, trainer.topology.rank)
    return MemoryReport(trainer) if on else None


def _run_all_pp_ranks(config: Any, registry: Any, args: argparse.Namespace) -> int:
    from titan_plugins_memory.sweep import run_all_pp_ranks

    return run_all_pp_ranks(config, registry, args)


def _configure_memory(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="memory_command", metavar="{view,compare}")
    view = sub.add_parser(
        "view",
        help="write a self-contained HTML page of a memory snapshot (CUDA or CPU)",
        description="Render a memory snapshot pickle (torch.cuda.memory._dump_snapshot, or titan's "
        "CPU snapshot) as one HTML file that needs no network: the allocation timeline and the "
        "largest live allocations at the peak, with their stack traces.",
    )
    view.add_argument("snapshot", metavar="SNAPSHOT.pickle")
    view.add_argument("-o", "--output", metavar="OUT.html", help="default: SNAPSHOT with .html")
    view.add_argument("--top", type=int, default=20, metavar="N", help="allocations listed at the peak")
    compare = sub.add_parser(
        "compare",
        help="two memory reports side by side, with differences",
        description="Print the observation points of two memory_report_rank<r>.json files side by "
        "side, with B - A and B / A for every figure, and the configuration fields that differ.",
    )
    compare.add_argument("a", metavar="A.json")
    compare.add_argument("b", metavar="B.json")
    compare.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(_memory_parser=parser)


def _run_memory(args: argparse.Namespace) -> int:
    if args.memory_command == "view":
        from titan_plugins_memory.view import run_view

        return run_view(args)
    if args.memory_command == "compare":
        from titan_plugins_memory.compare import run_compare

        return run_compare(args)
    args._memory_parser.print_help()
    return 2


def _configure_compare(parser: argparse.ArgumentParser) -> None:
    from titan_plugins_memory.runs import configure

    configure(parser)


def _run_compare(args: argparse.Namespace) -> int:
    from titan_plugins_memory.runs import run

    return run(args)


@hookimpl
def titan_callbacks() -> list[Callback]:
    return [
        Callback(
            "memory_report",
            _build_report,
            order=40,
            description="memory at the four observation points (fake backends, debug.memory_report)",
            outputs=(REPORT_PATTERN,),  # --overwrite removes them with the earlier run's own files
            serves=("debug.memory_report",),
        )
    ]


@hookimpl
def titan_run_options() -> list[RunOption]:
    return [
        RunOption(
            "all_pp_ranks",
            "--all-pp-ranks",
            "with --comm-backend fake: run every pipeline coordinate in turn and compare memory",
            _run_all_pp_ranks,
            outputs=(SWEEP_SUMMARY, SWEEP_LOGS),
        )
    ]


@hookimpl
def titan_commands() -> list[Command]:
    return [
        Command(
            "memory",
            "memory snapshots and reports: view (HTML), compare",
            _configure_memory,
            _run_memory,
        ),
        Command(
            "compare",
            "per-step losses and grad norms of runs side by side; fail beyond a tolerance",
            _configure_compare,
            _run_compare,
        ),
    ]
