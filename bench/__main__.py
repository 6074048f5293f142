"""`python -m bench [--only NAME[,NAME]] [--quick]`: run the benchmarks, write bench/results/<NAME>.json and
print a summary table. Benchmarks report; a missed target is shown, never an error exit."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback

from bench.common import RESULTS_DIR, format_table, write_result

MODULES = ("engine_decode", "engine_updates", "trainer_weight_sync", "trainer_vs_bare", "linear_kernels",
           "pipeline_vs_sync", "pipeline_heavy", "engine_vs_vllm", "engine_scale", "engine_gpu", "vllm_pause",
           "sandbox", "startup")


def discover() -> dict[str, object]:
    """{NAME: module} for every benchmark module that imports."""
    found = {}
    for module_name in MODULES:
        try:
            module = importlib.import_module(f"bench.{module_name}")
        except ImportError as e:
            print(f"skipping bench.{module_name}: {e}", file=sys.stderr)
            continue
        found[module.NAME] = module
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--only", default="", help="comma-separated benchmark names")
    parser.add_argument("--quick", action="store_true", help="smaller settings, fewer repeats (~30 s each)")
    args = parser.parse_args(argv)
    benchmarks = discover()
    wanted = [n for n in args.only.split(",") if n] or list(benchmarks)
    unknown = [n for n in wanted if n not in benchmarks]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(benchmarks)}")
    rows = []
    for name in wanted:
        print(f"== {name}{' (quick)' if args.quick else ''}", flush=True)
        t0 = time.perf_counter()
        try:
            result = benchmarks[name].run(quick=args.quick)
        except Exception as e:  # a broken benchmark is reported, the others still run
            traceback.print_exc()
            rows.append([name, "error", "", "", f"{type(e).__name__}: {e}"[:100], f"{time.perf_counter() - t0:.0f}s"])
            continue
        path = write_result(name, result)
        skipped = result.get("skipped")  # a benchmark that cannot run here (no GPU, no vLLM) says why
        rows.append([name, "-" if skipped else f"{result['ratio']:.3g}", f"{result['target']:.3g}",
                     "skipped" if skipped else "yes" if result["passed"] else "NO",
                     str(skipped or result.get("summary", ""))[:100], f"{time.perf_counter() - t0:.0f}s"])
        print(f"   wrote {path.relative_to(RESULTS_DIR.parent.parent)}", flush=True)
    print()
    print(format_table(rows, ["benchmark", "ratio", "target", "passed", "summary", "time"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
