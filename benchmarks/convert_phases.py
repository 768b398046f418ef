#!/usr/bin/env python3
"""Where a conversion's time and memory go: one rank's work, run in this process, phase by phase.

    python benchmarks/convert_phases.py import --hf-dir DIR --out DIR
    python benchmarks/convert_phases.py export --ckpt DIR --out DIR [--max-shard-bytes N]

A diagnostic, not a second converter: it calls the rank function the CLI runs
(``megagrpo.ckpt.convert.import_rank`` / ``export_rank``) at TP=PP=1 in this process, with timing
wrappers around the public megagrpo functions a conversion goes through, named by their public
module (``megagrpo.models.builder.build_stage``, ``megagrpo.ckpt.megatron.save_megatron``, ...) and
replaced wherever megagrpo's modules hold them (so the profile does not depend on which module
imports which), and around the Megatron checkpoint internals they reach (third-party, followed by
name). Every wrapped call appends one JSON line (pid, name, seconds, RssAnon/RssFile/VmHWM after
the call) to an event file; the forked checkpoint writers write theirs too. The summary (printed as
JSON on the last stdout line) aggregates the events per (process, name) and lists the memory after
each top-level phase. Call names keep the converter's prefix (``convert.build_stage``), as in
earlier results.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from common.sampling import proc_status  # noqa: E402


def memory() -> dict[str, int]:
    """RssAnon, RssFile and VmHWM of this process, in bytes."""
    return proc_status("self", ("RssAnon", "RssFile", "VmHWM"))


class Events:
    """Appends one JSON line per finished call; O_APPEND keeps lines from forked writers whole."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, name: str, seconds: float) -> None:
        end = time.perf_counter() - T_START
        record = {"pid": os.getpid(), "name": name, "start": end - seconds, "seconds": seconds, **memory()}
        os.write(self.fd, (json.dumps(record) + "\n").encode())

    def wrap(self, owner, attr: str, name: str | None = None) -> None:
        """Replace ``owner.attr`` (function, method or staticmethod) by a timed version."""
        raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        is_static = isinstance(raw, staticmethod)
        func = raw.__func__ if is_static else raw
        label = name or f"{getattr(owner, '__name__', owner)}.{attr}"

        timed = self.timed(func, label)
        setattr(owner, attr, staticmethod(timed) if is_static else timed)

    def timed(self, func, label: str):
        @functools.wraps(func)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                self.emit(label, time.perf_counter() - start)

        return timed

    def wrap_function(self, home, attr: str, name: str) -> None:
        """Replace the function ``home.attr`` by a timed version in every loaded megagrpo module
        that holds it (its own module and those that imported it by name)."""
        func = getattr(home, attr)
        timed = self.timed(func, name)
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("megagrpo"):
                for key, value in list(vars(module).items()):
                    if value is func:
                        setattr(module, key, timed)


def instrument(events: Events) -> None:
    """Timing wrappers: megagrpo's public functions that a conversion goes through, Megatron's
    checkpoint internals, the fsyncs and the writer processes' queues."""
    import multiprocessing.managers
    import multiprocessing.queues
    import os as os_module

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    import megagrpo.parallel
    from megagrpo.ckpt import convert, hf_files, megatron
    from megagrpo.models import builder, layout, mapping

    public = {
        "init_parallel": megagrpo.parallel,
        "build_stage": builder,
        "load_hf_into_stage": convert,
        "save_megatron": megatron,
        "load_megatron": megatron,
        "mapped_checkpoint_tensors": megatron,
        "destroy_parallel": megagrpo.parallel,
        "read_model": megatron,
        "to_megatron": mapping,
        "to_hf": mapping,
        "tp_shard": layout,
    }
    for attr, module in public.items():
        events.wrap_function(module, attr, f"convert.{attr}")
    events.wrap(hf_files.HFCheckpoint, "__init__", "HFCheckpoint.__init__ (headers)")
    events.wrap(hf_files.HFCheckpoint, "validate")
    events.wrap(hf_files.HFCheckpoint, "read")
    events.wrap_function(hf_files, "write_sharded", "convert.write_sharded (streaming safetensors)")
    events.wrap(dist_checkpointing, "save", "dist_checkpointing.save")
    events.wrap(dist_checkpointing, "load", "dist_checkpointing.load")
    events.wrap(filesystem_async, "_get_write_results_queue", "dcp: spawn Manager() results queue")
    writer = filesystem_async.FileSystemWriterAsync
    events.wrap(writer, "prepare_write_data", "dcp: prepare_write_data")
    events.wrap(writer, "write_preloaded_data_multiproc", "dcp: fork writers + write + join")
    events.wrap(writer, "write_preloaded_data", "dcp writer: write + fsync (forked process)")
    events.wrap(os_module, "fsync", "os.fsync")
    events.wrap(multiprocessing.queues.JoinableQueue, "join", "dcp: wait for writers (JoinableQueue.join)")
    # Megatron hands the write results back through a queue served by a spawned Manager process.
    events.wrap(multiprocessing.managers.BaseProxy, "_callmethod", "dcp: Manager queue call (put/get)")


def summarize(events_path: Path, t_imported: float, t_end: float) -> dict:
    records = [json.loads(line) for line in events_path.read_text().splitlines()]
    me = os.getpid()
    totals: dict[str, dict] = {}
    for r in records:
        key = r["name"] if r["pid"] == me else f"[pid {r['pid']}] {r['name']}"
        t = totals.setdefault(key, {"first_start": r["start"], "seconds": 0.0, "calls": 0, "max_vmhwm": 0})
        t["seconds"] += r["seconds"]
        t["calls"] += 1
        t["max_vmhwm"] = max(t["max_vmhwm"], r["VmHWM"])
        t["rss_anon_after_last"] = r["RssAnon"]
        t["rss_file_after_last"] = r["RssFile"]
    return {
        "import_seconds": t_imported - T_START,
        "total_seconds": t_end - T_START,
        "final_memory": memory(),
        "calls": dict(sorted(totals.items(), key=lambda kv: kv[1]["first_start"])),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("direction", choices=("import", "export"))
    parser.add_argument("--hf-dir", help="import: the HF source directory")
    parser.add_argument("--ckpt", help="export: the megagrpo checkpoint")
    parser.add_argument("--out", required=True, help="output directory (created; must not exist)")
    parser.add_argument("--max-shard-bytes", type=int, default=5 * 1024**3)
    args = parser.parse_args(argv)

    from megagrpo.ckpt import convert
    from megagrpo.compat.startup import weights_only_process
    from megagrpo.parallel.local import free_port

    t_imported = time.perf_counter()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with tempfile.TemporaryDirectory() as tmp:
        events = Events(Path(tmp) / "events.jsonl")
        events.emit("imports (torch, megatron, megagrpo)", t_imported - T_START)
        start = time.perf_counter()
        with weights_only_process():  # as the rank imports Megatron
            instrument(events)
        events.emit("imports (megatron.core.dist_checkpointing)", time.perf_counter() - start)
        out = Path(args.out)
        out.mkdir(parents=True)
        if args.direction == "import":
            convert.import_rank(0, 1, args.hf_dir, str(out), 1, 1)
        else:
            convert.export_rank(0, 1, args.ckpt, str(out), args.max_shard_bytes)
        summary = summarize(events.path, t_imported, time.perf_counter())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
