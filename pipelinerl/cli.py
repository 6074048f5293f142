"""The `pipelinerl` command: run, serve, and the tools around them."""

from __future__ import annotations

import argparse
import sys


def _run(args: argparse.Namespace) -> int:
    from pipelinerl.launch import main as launch_main

    # flags may come among the overrides (`run RECIPE a=1 --dry-run`, as a batch script appends its own
    # overrides after the user's arguments), which argparse leaves in the remainder
    flags = [o for o in args.overrides if o.startswith("--")]
    unknown = [f for f in flags if f != "--dry-run"]
    if unknown:
        print(f"pipelinerl run: unknown option {unknown[0]} (see pipelinerl run --help)", file=sys.stderr)
        return 2
    overrides = [o for o in args.overrides if not o.startswith("--")]
    return launch_main(args.recipe, overrides, dry_run=args.dry_run or bool(flags))


def _serve(args: argparse.Namespace) -> int:
    from pipelinerl import serve

    serve.main(args)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from pipelinerl.plot import plot_runs

    try:
        paths = plot_runs(args.run_dirs, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"pipelinerl plot: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pipelinerl import eval as evaluation

    return evaluation.main(args)


def _conformance(args: argparse.Namespace) -> int:
    from pipelinerl import conformance

    return conformance.main(args)


def _plan(args: argparse.Namespace) -> int:
    from pipelinerl import plan

    return plan.main(args)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with `command` only that command's arguments filled in: the modules that add
    the others' (serve, eval, conformance, plan) import torch, transformers and more, about 2 s that `pipelinerl
    run` would spend before it starts any role."""

    def wanted(name: str) -> bool:
        return command is None or command == name

    parser = argparse.ArgumentParser(prog="pipelinerl", description="Pipelined RL for LLM reasoners with "
                                     "in-flight weight updates.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run a recipe end to end",
                         description="Run a recipe: engines, actor, rewards and trainer as separate processes.")
    run.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny_cpu.yaml")
    run.add_argument("overrides", nargs=argparse.REMAINDER, help="dotted overrides, e.g. trainer.lr=1e-6")
    run.add_argument("--dry-run", action="store_true",
                     help="print every process this node would start (command, environment, GPUs, ports, log), the "
                          "model and where it comes from, the engine package, and whether the run could start "
                          "here; start nothing (exit 0: it could, 2: it could not)")
    run.set_defaults(func=_run)

    srv = sub.add_parser("serve", help="serve a model through the inference contract",
                         description="Start an inference server implementing the pipelinerl contract.")
    if wanted("serve"):
        from pipelinerl import serve

        serve.add_arguments(srv)
    srv.set_defaults(func=_serve)

    ev = sub.add_parser("eval", help="evaluate a model: avg@k and pass@k per benchmark, and their mean",
                        description="Evaluate a model served by any engine on a task or dataset.")
    if wanted("eval"):
        from pipelinerl import eval as evaluation

        evaluation.add_arguments(ev)
    ev.set_defaults(func=_eval)

    conf = sub.add_parser("conformance", help="check an engine against the inference contract",
                          description="Run the contract's conformance suite against an engine URL; prints a "
                                      "PASS/FAIL table and exits non-zero on failure.")
    if wanted("conformance"):
        from pipelinerl import conformance

        conformance.add_arguments(conf)
    conf.set_defaults(func=_conformance)

    pl = sub.add_parser("plan", help="where every process goes and the memory each GPU needs (no GPU needed)",
                        description="Plan a recipe on a cluster (its `resources`, or the flags): placement per node, "
                                    "memory per GPU, whether it fits and what to change if not. Exit 0: fits, "
                                    "1: does not fit, 2: config error.")
    if wanted("plan"):
        from pipelinerl import plan as planning

        planning.add_arguments(pl)
    pl.set_defaults(func=_plan)

    plot = sub.add_parser("plot", help="PNG curves of one or more runs",
                          description="Write curves_step.png and curves_time.png (and eval_benchmarks.png, one curve "
                                      "per evaluation benchmark, when there are several) from RUN_DIR/metrics.jsonl.")
    plot.add_argument("run_dirs", nargs="+", help="run directories; several overlay")
    plot.add_argument("--out", default=None, help="output directory (default: the first run directory)")
    plot.set_defaults(func=_plot)

    # `pipelinerl data orz`: ORZ's public data, fetched and checked against pinned checksums
    from pipelinerl import data as data_cmd

    dat = sub.add_parser("data", help="fetch and verify public datasets (orz: Open-Reasoner-Zero's; prorl: the "
                                      "sources of recipes/prorl_1p5b.yaml)",
                         description=data_cmd.__doc__.split("\n\n")[0] + " Each file is checked against a pinned "
                         "checksum before it is kept; --check verifies without downloading. `pipelinerl data prorl`: "
                         "ProRL's domains from the Hugging Face hub into data/prorl/, each file's sha256 recorded "
                         "when first written and checked after.",
                         epilog=data_cmd.EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    data_cmd.add_arguments(dat)
    dat.set_defaults(func=data_cmd.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pipelinerl.procs import die_with_parent

    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    # only the command given gets its arguments (and imports); with none (`--help`) all do. An unknown command gets
    # none: argparse names the valid ones from the subcommands themselves
    command = argv[0] if argv and not argv[0].startswith("-") else None
    args = build_parser(command).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
