"""AdamW on the host: parameters per second of the update ``offload_optimizer`` runs
(``usp.train.host_optimizer.HostAdamW``: torch's single-tensor AdamW on float32 shards),
next to the planner's assumption (``usp.planner.hardware.HOST_ADAM_PARAMS_PER_S``).

    python benchmarks/host_adam.py --params 50000000 --threads 1
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=int, default=50_000_000, help="parameters updated")
    p.add_argument("--tensors", type=int, default=10, help="split over this many tensors")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    import torch
    from torch.optim.adamw import adamw

    from usp.planner.hardware import HOST_ADAM_PARAMS_PER_S

    torch.set_num_threads(args.threads)
    n = args.params // args.tensors
    params = [torch.randn(n) for _ in range(args.tensors)]
    grads = [torch.randn(n) for _ in range(args.tensors)]
    moments = [torch.zeros(n) for _ in range(2 * args.tensors)]
    steps = [torch.tensor(0.0) for _ in range(args.tensors)]
    best = float("inf")
    for _ in range(args.repeats):
        started = time.perf_counter()
        adamw(params, grads, moments[::2], moments[1::2], [], steps, foreach=False,
              amsgrad=False, beta1=0.9, beta2=0.95, lr=1e-4, weight_decay=0.1, eps=1e-8,
              maximize=False)  # fmt: skip
        best = min(best, time.perf_counter() - started)
    row = {"params": n * args.tensors, "threads": args.threads, "seconds": best,
           "params_per_s": n * args.tensors / best, "planned_per_rank": HOST_ADAM_PARAMS_PER_S}  # fmt: skip
    print(f"host AdamW: {row['params_per_s'] / 1e9:.3f}e9 parameters/s on {args.threads} "
          f"thread(s) ({best:.3f} s for {row['params']:,}); the planner assumes "
          f"{HOST_ADAM_PARAMS_PER_S / 1e9:.2f}e9 per rank")  # fmt: skip
    return row


if __name__ == "__main__":
    main()
