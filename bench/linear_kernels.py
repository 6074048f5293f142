"""The trainer's float32 matmul kernel on this CPU: torch's BLAS (MKL) against oneDNN (`trainer.linear_kernel`).

`python -m bench.linear_kernels [--quick] [--threads N]` (or `python -m bench --only linear_kernels`):
- `products`: GFLOP/s of a training step's three products (forward x W^T, input gradient dy W, weight gradient
  dy^T x) by each kernel, for the weight shapes of recipes/counting_cpu.yaml's model (hidden 512) and of
  Qwen2.5-0.5B (hidden 896), TOKENS rows, best of REPEATS calls each (`pipelinerl.trainer.linear_kernels`'
  own operands and calls);
- `step`: seconds of one forward and backward of counting_cpu's model shape (Qwen2, hidden 512, 6 layers,
  vocabulary 100; random weights) on STEP_BATCH rows of STEP_LEN tokens, interleaved rounds of three sides:
  every linear layer through BLAS (`blas`), through oneDNN (`onednn`), and as `trainer.linear_kernel: auto`
  chooses on this machine (`auto`);
- `head`: seconds of the trainer's chunked LM head (`trainer.forward.ChunkedHeadLogprobs`: log-probs and entropy,
  forward and backward, HEAD_CHUNK rows at a time) on HEAD_ROWS rows of hidden 512 and a HEAD_VOCAB vocabulary,
  its three products on BLAS against oneDNN (what a routed head uses), interleaved rounds.
Threads: THREADS (the counting recipe's trainer.threads) unless --threads. Target: `ratio` = blas / auto step
seconds >= 1, that is, the default never makes a step slower than torch's own path (on a CPU where BLAS wins,
auto keeps it). Writes bench/results/linear_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench.common import format_table, interleaved, machine, verdict, write_result

NAME = "linear_kernels"
THREADS = 2
TOKENS, REPEATS = 2048, 5
STEP_BATCH, STEP_LEN, ROUNDS = 16, 256, 5
HEAD_ROWS, HEAD_HIDDEN, HEAD_VOCAB, HEAD_CHUNK = 2048, 512, 16384, 1024
SHAPES = {  # (out, in) of each model's linear layers: q, k/v, o, gate/up (each), down
    "counting_cpu (h512)": [(512, 512), (256, 512), (2048, 512), (512, 2048)],
    "Qwen2.5-0.5B (h896)": [(896, 896), (128, 896), (4864, 896), (896, 4864)],
}


@torch.no_grad()
def products(rows: int, repeats: int) -> list[dict]:
    from pipelinerl.trainer.linear_kernels import best_seconds, training_products

    out = []
    for model, shapes in SHAPES.items():
        for out_f, in_f in shapes:
            x, w, dy = torch.rand(rows, in_f), torch.rand(out_f, in_f), torch.rand(rows, out_f)
            flops = 2 * rows * out_f * in_f
            row = {"model": model, "shape": f"{out_f}x{in_f}", "rows": rows}
            for product, blas, onednn in training_products(x, w, dy):
                row[product] = {"blas_gflops": round(flops / best_seconds(blas, repeats) / 1e9, 1),
                                "onednn_gflops": round(flops / best_seconds(onednn, repeats) / 1e9, 1)}
            out.append(row)
    return out


def step(rounds: int) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipelinerl.trainer.linear_kernels import choose_shapes, route_linears, unroute_linears

    config = Qwen2Config(vocab_size=100, hidden_size=512, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=2048, tie_word_embeddings=True,
                         attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    ids = torch.randint(3, 100, (STEP_BATCH, STEP_LEN))
    auto = choose_shapes(model, "auto")
    every = choose_shapes(model, "onednn")

    def side(shapes):
        def run():
            unroute_linears(model)
            route_linears(model, shapes)
            model.zero_grad(set_to_none=True)
            model(input_ids=ids).logits.logsumexp(-1).mean().backward()
        return run

    wall, _ = interleaved({"blas": side(set()), "onednn": side(every), "auto": side(auto)}, rounds)
    return {"seconds": {k: round(statistics.median(v), 4) for k, v in wall.items()},
            "rounds": {k: [round(t, 4) for t in v] for k, v in wall.items()},
            "auto_chose": sorted(f"{o}x{i}" for o, i in auto),
            "blas_over_auto_rounds": sorted(round(b / a, 3) for b, a in zip(wall["blas"], wall["auto"])),
            "tokens": STEP_BATCH * STEP_LEN}


def head(rounds: int, rows: int = HEAD_ROWS) -> dict:
    from pipelinerl.trainer.forward import ChunkedHeadLogprobs

    torch.manual_seed(0)
    hidden = torch.randn(rows, HEAD_HIDDEN, requires_grad=True)
    weight = (torch.randn(HEAD_VOCAB, HEAD_HIDDEN) / HEAD_HIDDEN**0.5).requires_grad_()
    targets = torch.randint(0, HEAD_VOCAB, (rows,))

    def side(onednn):
        def run():
            hidden.grad = weight.grad = None
            lp, _ = ChunkedHeadLogprobs.apply(hidden, weight, None, targets, 1.0, HEAD_CHUNK, torch.float32, True,
                                              False, onednn)
            lp.sum().backward()
        return run

    wall, _ = interleaved({"blas": side(False), "onednn": side(True)}, rounds)
    return {"seconds": {k: round(statistics.median(v), 4) for k, v in wall.items()},
            "blas_over_onednn_rounds": sorted(round(b / o, 3) for b, o in zip(wall["blas"], wall["onednn"])),
            "shape": {"rows": rows, "hidden": HEAD_HIDDEN, "vocab": HEAD_VOCAB, "chunk": HEAD_CHUNK}}


def run(quick: bool = False, threads: int = THREADS) -> dict:
    torch.set_num_threads(threads)
    rows = products(512 if quick else TOKENS, 2 if quick else REPEATS)
    measured = step(2 if quick else ROUNDS)
    lm_head = head(2 if quick else ROUNDS, 1024 if quick else HEAD_ROWS)
    head_ratio = statistics.median(lm_head["blas_over_onednn_rounds"])
    ratio = statistics.median(measured["blas_over_auto_rounds"])
    onednn = statistics.median(b / o for b, o in zip(measured["rounds"]["blas"], measured["rounds"]["onednn"]))
    return {"name": NAME, **verdict(ratio, 1.0),
            "ratio_is": "blas / auto seconds of a forward and backward (median of interleaved rounds)",
            "summary": f"step: blas {measured['seconds']['blas']:.2f} s, onednn {measured['seconds']['onednn']:.2f} s "
                       f"({onednn:.2f}x), auto {measured['seconds']['auto']:.2f} s ({ratio:.2f}x); products "
                       f"{min(_speedups(rows)):.2f}-{max(_speedups(rows)):.2f}x; chunked LM head (vocab "
                       f"{HEAD_VOCAB}) blas {lm_head['seconds']['blas']:.2f} s, onednn "
                       f"{lm_head['seconds']['onednn']:.2f} s ({head_ratio:.2f}x)",
            "products": rows, "step": measured, "head": lm_head,
            "settings": {"threads": threads, "rows": 512 if quick else TOKENS, "step_batch": [STEP_BATCH, STEP_LEN]},
            "machine": machine()}


def _speedups(rows: list[dict]) -> list[float]:
    return [r[p]["onednn_gflops"] / r[p]["blas_gflops"] for r in rows for p in ("forward", "input_grad", "weight_grad")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.linear_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rows and rounds (~20 s)")
    parser.add_argument("--threads", type=int, default=THREADS)
    args = parser.parse_args(argv)
    result = run(args.quick, args.threads)
    print(f"cpu: {result['machine']['cpu']} ({result['machine']['cpu_family']}), threads {args.threads}")
    print(format_table([[r["model"], r["shape"], *(f"{r[p]['blas_gflops']:.0f} / {r[p]['onednn_gflops']:.0f}"
                                                   for p in ("forward", "input_grad", "weight_grad"))]
                        for r in result["products"]],
                       ["model", "weight", "forward GFLOP/s (BLAS / oneDNN)", "input grad", "weight grad"]))
    print(json.dumps({k: result[k] for k in ("ratio", "passed", "summary")}, indent=1))
    write_result(NAME, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
