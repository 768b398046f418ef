"""The trainers: GRPO (``grpo``), SFT (``sft``), DPO (``dpo``) and the tiny model's warm-up (``warmup``),
each a set of steps run by the one run skeleton (``run``: resume, Ctrl-C, checkpoint and validation
cadences, export, report), with checkpoints written by ``checkpoints`` and GRPO's generate / train / sync
schedule in ``overlap``."""
