"""The colocated handoff (``megagrpo.weight_sync.ipc``): buckets through two shared slots between two
processes on one device, in GB/s, every byte checked.

    python -m benchmarks.ipc_handoff [--device cpu|cuda] [--size-mb 1024] [--bucket-mb 64 256]
        [--repeat 3] [--quick]

The sender (this process) owns the slots (``IpcSender``: on CUDA one allocation exported by CUDA IPC
handle, on CPU a file in /dev/shm both map) and the receiver (a spawned process, ``IpcReceiver``) copies
each bucket out into its own buffer on the same device and acknowledges it, which frees the slot two
buckets later: the protocol of a colocated sync, without the model around it. Per round and
``--bucket-mb``: ``--size-mb`` of data (a fixed random source on the device, cut into buckets) packed
into the slots and handed over; the time runs from the first bucket's packing to the receipt of the
last (``IpcSender.finish``). The receiver then compares every bucket it received with the source, which
it builds itself from the same seed: the fraction of rounds whose bytes all arrived must be 1.
"""

from __future__ import annotations

import time

import torch

from .common import record
from .common.record import Measurement

QUICK = {"size_mb": 16, "bucket_mb": [4]}
TIMEOUT_S = 300.0


def parse_args(argv=None):
    p = record.parser("ipc_handoff", __doc__)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--size-mb", type=int, default=1024, help="bytes handed over per round (a sync's)")
    p.add_argument("--bucket-mb", type=int, nargs="+", default=[64, 256], help="bucket sizes, a series each")
    return record.parse(p, argv, QUICK)


def source(size: int, device: str) -> torch.Tensor:
    """The data of a round: ``size`` random bytes, the same in both processes."""
    gen = torch.Generator().manual_seed(17)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).to(device)


def receiver_main(port: int, device: str, size: int, bucket: int, rounds: int, result) -> None:
    """The spawned receiver: every bucket of every round copied out, then compared with the source."""
    from megagrpo.weight_sync.ipc import IpcAddress, IpcReceiver

    want = source(size, device)
    got = torch.empty_like(want)
    receiver = IpcReceiver(
        IpcAddress("127.0.0.1", port, 0), device=torch.device(device), timeout_s=TIMEOUT_S, name="bench"
    )
    exact = []
    index = 0
    for _ in range(rounds):
        for start in range(0, size, bucket):
            receiver.receive(index, got[start : start + bucket])
            index += 1
        exact.append(bool(torch.equal(got, want)))
        got.zero_()
    receiver.close()
    result.put(exact)


def measure(args, bucket_mb: int) -> tuple[list[float], list[bool]]:
    """``--repeat`` timed rounds (after one untimed) of ``--size-mb`` in buckets of ``bucket_mb``."""
    import torch.multiprocessing as mp

    from megagrpo.parallel.local import free_port
    from megagrpo.weight_sync.ipc import IpcAddress, IpcSender

    size, bucket = args.size_mb << 20, min(bucket_mb, args.size_mb) << 20
    rounds = args.repeat + 1
    data = source(size, args.device)
    ctx = mp.get_context("spawn")
    result, port = ctx.Queue(), free_port()
    proc = ctx.Process(target=receiver_main, args=(port, args.device, size, bucket, rounds, result))
    proc.start()
    try:
        addr = IpcAddress("127.0.0.1", port, 0)
        sender = IpcSender(addr, bucket, device=torch.device(args.device), timeout_s=TIMEOUT_S, name="bench")
        seconds, index = [], 0
        for _ in range(rounds):
            start_t = time.perf_counter()
            for n, start in enumerate(range(0, size, bucket)):
                piece = data[start : start + bucket]
                sender.slot(n)[: piece.numel()].copy_(piece)
                sender.post(n, index)
                index += 1
            sender.finish()
            seconds.append(time.perf_counter() - start_t)
        exact = result.get(timeout=TIMEOUT_S)
        sender.close()
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    return seconds[1:], exact[1:]


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    out = []
    for bucket_mb in args.bucket_mb:
        start = time.perf_counter()
        seconds, exact = measure(args, bucket_mb)
        s = {"device": args.device, "size_mb": args.size_mb, "bucket_mb": min(bucket_mb, args.size_mb)}
        gb = (args.size_mb << 20) / 1e9
        out += [
            Measurement("handoff", seconds, "s", s),
            # README's table: the largest bucket's rate (the smaller ones are in the results' table).
            Measurement(
                "handoff rate",
                [gb / t for t in seconds],
                "GB/s",
                s,
                headline=bucket_mb == max(args.bucket_mb),
            ),
            Measurement(
                "rounds whose bytes all arrived", [sum(exact) / len(exact)], "fraction", s, target=">= 1"
            ),
        ]
        took = time.perf_counter() - start
        print(f"[ipc_handoff] bucket {bucket_mb} MB: {gb / min(seconds):.2f} GB/s at best ({took:.0f} s)")
    what = "the colocated weight handoff: buckets through two shared slots, two processes, one device"
    notes = [
        "cpu: the slots are a /dev/shm file both processes map; cuda: one allocation shared by IPC handle"
    ]
    return record.write(args, "ipc_handoff", what, out, packages=("torch",), notes=notes)


if __name__ == "__main__":
    main()
