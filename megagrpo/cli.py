"""``megagrpo`` command line: thin argument parsing over the package.

Subcommands that belong to work not yet landed say so and exit with status 2; none prints fake output.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from megagrpo.compat.process_exit import exit_without_teardown
from megagrpo.compat.upstream_warnings import silence_in_this_program

_NOT_YET: dict[str, str] = {}
RESUME_HELP = "resume from the latest complete checkpoint (the same as checkpoint.resume=true)"


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    from megagrpo.config_files import DEFAULT_CONFIG_NAME, packaged_config_names

    shipped = ", ".join(packaged_config_names())
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE|NAME",
        help=f"YAML file, or the name of a config shipped with megagrpo ({shipped}); default: "
        f"{DEFAULT_CONFIG_NAME}, the embedded tiny CPU job (configs/{DEFAULT_CONFIG_NAME}.yaml)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides applied after the file, e.g. grpo.num_generations=8 parallel.backend=gloo",
    )


def _parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    upper = text.strip().upper()
    for unit, scale in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * scale)
    if upper.isdigit():
        return int(upper)
    raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB, 500MB or 1000000")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megagrpo",
        description="Megatron-Core + vLLM GRPO trainer.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # The trainers: a config, overrides and --resume each.
    for name, what in (
        ("train", "run GRPO: vLLM rollouts, rewards, Megatron updates, weight sync"),
        ("distill", "on-policy distillation: the student samples, a teacher scores its tokens (reverse KL)"),
        ("sft", "supervised fine-tuning on chat/instruction data (loss on assistant tokens only)"),
        ("dpo", "preference optimisation (DPO / IPO) against the frozen initial policy"),
    ):
        p = sub.add_parser(name, help=what)
        _add_config_args(p)
        p.add_argument("--resume", action="store_true", help=RESUME_HELP)

    p = sub.add_parser(
        "eval",
        help="pass@1 averaged over N samples and unbiased pass@k of a model, on vLLM engines "
        "(the problems of eval.path, default data.val_path)",
    )
    _add_config_args(p)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--model",
        metavar="HF_DIR",
        help="HF model directory (config, tokenizer, safetensors), or a PEFT LoRA adapter directory "
        "(adapter_config.json + adapter_model.safetensors): its base with the adapter merged in",
    )
    which.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="a run checkpoint (step_N/, verified, then exported) or a run directory (its HF export, "
        "else its latest verified checkpoint)",
    )
    p.add_argument(
        "--samples", type=int, default=None, help="samples per problem (default: eval.num_samples)"
    )
    p.add_argument("--out", default=None, help="output directory (default: <logging.dir>/<run_name>/eval)")
    p.add_argument(
        "--base",
        metavar="HF_DIR",
        default=None,
        help="with --model of a PEFT adapter: its base HF directory (default: the adapter config's "
        "base_model_name_or_path)",
    )

    _add_plan_parser(sub)

    p = sub.add_parser("export", help="Megatron checkpoint -> HF directory (safetensors, config, tokenizer)")
    p.add_argument(
        "--ckpt",
        required=True,
        help="megagrpo checkpoint directory (from hf_to_megatron, or a run's step_N/, verified first)",
    )
    p.add_argument("--out", required=True, help="HF output directory (must not exist)")
    p.add_argument(
        "--peft",
        action="store_true",
        help="write the PEFT adapter directory of a policy.lora run's checkpoint (adapter_config.json + "
        "adapter_model.safetensors) instead of the merged HF model",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        type=_parse_size,
        help="largest safetensors file, e.g. 5GB, 500MB (default 5GB)",
    )

    p = sub.add_parser(
        "warmup",
        help="supervised warm-up of the tiny model on the synthetic task (Megatron ranks, real optimizer)",
    )
    _add_config_args(p)
    return parser


def _add_plan_parser(sub) -> None:
    """``megagrpo plan``'s options."""
    p = sub.add_parser(
        "plan",
        help="check a config against its model shape; per-rank memory and sync traffic (starts nothing)",
    )
    _add_config_args(p)
    p.add_argument(
        "--trainer",
        choices=["grpo", "distill", "sft", "dpo"],
        default="grpo",
        help="the command that will run the config, whose rules apply: grpo (megagrpo train, the default), "
        "distill, sft or dpo; sft and dpo start no engines, so their plan has no engine or sync part",
    )
    p.add_argument(
        "--hf-config",
        help="HF config.json to take the model shape from instead of model.hf_dir; with model.init_from, "
        "the shape of the model that earlier run will leave (the run itself is checked at start)",
    )
    p.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory per GPU (default 80)")
    p.add_argument("--link-gbps", type=float, default=100.0, help="link speed for the sync estimate (Gb/s)")
    p.add_argument(
        "--transformer-engine",
        choices=["here", "yes", "no"],
        default="here",
        help="whether the trainer's machines have Transformer Engine (for transformer_impl auto); "
        "'here' resolves it on this machine, as the runtime does where it runs",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _load(args: argparse.Namespace):
    from megagrpo.config import load_config

    # --resume is the command line's spelling of checkpoint.resume: one switch.
    resume = ["checkpoint.resume=true"] if getattr(args, "resume", False) else []
    # Validated for the command's trainer: `plan` for the one its --trainer names; sft/dpo/warmup configs
    # need no GRPO keys.
    trainer = args.trainer if args.command == "plan" else {"train": "grpo"}.get(args.command, args.command)
    return load_config(args.config, [*args.overrides, *resume], trainer=trainer)


def _plan(args: argparse.Namespace) -> int:
    from megagrpo.config import ConfigError
    from megagrpo.plan import make_plan, read_shape, render
    from megagrpo.trainers.checkpoints import resolve_init_from

    cfg = _load(args)
    if args.hf_config is None and cfg.model.init_from is not None:
        # A later stage: the shape is its previous stage's model's, read from that run's result.
        try:
            cfg = resolve_init_from(cfg)
        except ConfigError as err:
            note = " (or give megagrpo plan --hf-config FILE: the config.json of the model it will leave)"
            raise err.with_context(note=note) from None
    shape, where = read_shape(cfg, args.hf_config)
    te = {"here": None, "yes": True, "no": False}[args.transformer_engine]
    plan = make_plan(
        cfg,
        shape,
        where,
        gpu_memory_gib=args.gpu_memory_gib,
        link_gbps=args.link_gbps,
        transformer_engine=te,
        trainer=args.trainer,
    )
    if args.json:
        print(plan.to_json())
    else:
        render(plan, cfg)
    return 1 if plan.errors else 0


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megagrpo.ckpt.links import check_no_outside_links
    from megagrpo.ckpt.peft_merge import is_peft_dir, merged_for_eval, peft_base, read_peft_config
    from megagrpo.config import load_config
    from megagrpo.evaluate import run_eval
    from megagrpo.trainers.checkpoints import model_dir_for_eval

    def evaluated(model: Path) -> list[str]:
        # The model evaluated is the config's model (its tokenizer reads the problems), whatever
        # model the config names for training.
        return [
            "model.init_from=null",
            "model.tiny=null",
            "model.megatron_ckpt=null",
            f"model.hf_dir={model}",
        ]

    if args.samples is not None and args.samples < 1:
        print("megagrpo eval: error: --samples must be >= 1", file=sys.stderr)
        return 1
    given = Path(args.model or args.checkpoint)
    peft = args.model is not None and is_peft_dir(given)
    if args.base is not None and not peft:
        print("megagrpo eval: error: --base needs --model of a PEFT adapter directory", file=sys.stderr)
        return 1
    # A PEFT adapter's base names the tokenizer; it is checked before anything is merged.
    named = peft_base(given, read_peft_config(given), args.base) if peft else given
    cfg = load_config(args.config, [*args.overrides, *evaluated(named)], trainer="eval")
    out = Path(args.out) if args.out else Path(cfg.logging.dir) / cfg.run_name / "eval"
    if peft:
        model_dir = merged_for_eval(given, out, base=named)
    else:
        model_dir = given if args.model else model_dir_for_eval(given, out)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (an HF model directory is expected)")
    check_no_outside_links(model_dir)  # the engines read it; eval's report names it
    cfg = load_config(args.config, [*args.overrides, *evaluated(model_dir)], trainer="eval")
    report = run_eval(cfg, model_dir, out, samples=args.samples)
    print(report.to_markdown(f"megagrpo eval: {cfg.run_name}"))
    print(f"wrote {out / 'eval.json'} and {out / 'eval.md'}")
    return 0


def _warmup(args: argparse.Namespace) -> int:
    from megagrpo.trainers.warmup import run_warmup

    cfg = _load(args)
    par = cfg.parallel
    print(
        f"megagrpo warmup: tiny Qwen2-shaped model, Megatron-Core over {par.backend} with "
        f"{par.world_size} rank(s) (TP={par.tensor_model_parallel_size}, "
        f"PP={par.pipeline_model_parallel_size}, DP={par.data_parallel_size}), "
        f"{cfg.warmup.steps} optimizer steps of SFT on synthetic arithmetic",
        flush=True,
    )
    res = run_warmup(cfg)
    if res is None:  # a non-reporting rank under torchrun
        return 0
    print(
        f"\nwarm-up done in {res.seconds:.1f}s of step time ({res.tokens_per_s:.0f} training tokens/s)\n"
        f"  final answer-token loss  {res.final_loss:.4f}\n"
        f"  greedy exact-match accuracy on held-out prompts: "
        f"{res.accuracy_before:.1%} -> {res.accuracy_after:.1%}\n"
        f"  metrics: {res.metrics_path}"
    )
    return 0


def _sft(args: argparse.Namespace) -> int:
    from megagrpo.trainers.sft import run_sft

    cfg = _load(args)
    try:
        res = run_sft(cfg)
    except KeyboardInterrupt:
        return 130
    if res is not None:
        _print_validation("sft", res.first, res.last)
    return 0


def _dpo(args: argparse.Namespace) -> int:
    from megagrpo.trainers.dpo import run_dpo

    cfg = _load(args)
    try:
        res = run_dpo(cfg)
    except KeyboardInterrupt:
        return 130
    if res is not None:
        _print_validation("dpo", res.first, res.last)
    return 0


def _print_validation(command: str, first: dict, last: dict) -> None:
    print(f"megagrpo {command}: validation before -> after")
    keys = sorted(set(first) | set(last))
    for key in keys:
        before = f"{first[key]:.4f}" if key in first else "-"
        after = f"{last[key]:.4f}" if key in last else "-"
        print(f"  {key}: {before} -> {after}")


def _train(args: argparse.Namespace) -> int:
    from megagrpo.ckpt.run import CheckpointWriteError
    from megagrpo.runtime.faults import FAULT_EXIT, RunFault
    from megagrpo.trainers.grpo import train

    cfg = _load(args)
    try:
        train(cfg)
    except KeyboardInterrupt:
        return 130
    except RunFault as err:
        # A supervisor (launch/supervise.sh) relaunches with --resume on this status.
        print(f"megagrpo {args.command}: stopped: {err}", file=sys.stderr)
        return FAULT_EXIT
    except CheckpointWriteError as err:
        print(f"megagrpo {args.command}: stopped: {err}", file=sys.stderr)
        return 1
    return 0


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megagrpo.ckpt import manifest
    from megagrpo.ckpt.convert import megatron_to_hf
    from megagrpo.ckpt.lora_export import export_merged, export_peft, is_lora_checkpoint

    try:
        ckpt = Path(args.ckpt)
        if (ckpt / manifest.MANIFEST_NAME).is_file() or (ckpt / "driver_state.json").is_file():
            # A run checkpoint (step_N/) is exported only once every file matches its manifest.
            nbytes = manifest.verify(ckpt)
            print(f"verified {ckpt}: {nbytes / 1e6:.1f} MB match {manifest.MANIFEST_NAME}")
        if args.peft:
            out = export_peft(ckpt, args.out, in_process=True)
        elif is_lora_checkpoint(ckpt):  # adapters only: merged into the base they refer to
            out = export_merged(ckpt, args.out, max_shard_bytes=args.max_shard_size, in_process=True)
        else:
            out = megatron_to_hf(args.ckpt, args.out, max_shard_bytes=args.max_shard_size, in_process=True)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"megagrpo export: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {'PEFT adapter' if args.peft else 'HF checkpoint'} {out}")
    return 0


def _input_errors() -> tuple[type[Exception], ...]:
    from megagrpo.ckpt import CheckpointError
    from megagrpo.data.errors import DataError
    from megagrpo.models.registry import UnsupportedModelError

    return (DataError, CheckpointError, UnsupportedModelError, FileExistsError, FileNotFoundError)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command in this process and return its exit status (the in-process API)."""
    return _dispatch(build_parser().parse_args(argv))


def run(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``megagrpo`` program: run one command, then end the process."""
    silence_in_this_program()  # other libraries' non-actionable warnings, here and in its workers
    args = build_parser().parse_args(argv)
    code = _dispatch(args)
    if args.command in _NO_TEARDOWN:
        exit_without_teardown(code)
    sys.exit(code)


# Commands whose process has nothing left to do when they return: an export's files are written,
# synced and renamed into place, and what it leaves behind is only memory.
_NO_TEARDOWN = {"export"}


def _dispatch(args: argparse.Namespace) -> int:
    if args.command in _NOT_YET:
        print(f"megagrpo {args.command}: not implemented: {_NOT_YET[args.command]}.", file=sys.stderr)
        return 2
    from megagrpo.config import ConfigError

    try:
        commands = {"plan": _plan, "warmup": _warmup, "export": _export, "train": _train, "distill": _train}
        return (commands | {"sft": _sft, "dpo": _dpo, "eval": _eval})[args.command](args)
    except ConfigError as err:
        print(f"megagrpo {args.command}: config error: {err}", file=sys.stderr)
        return 1
    except _input_errors() as err:
        # Bad input found before any worker started (datasets, checkpoints, model files).
        print(f"megagrpo {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    run()
