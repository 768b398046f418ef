"""Checkpoints and checkpoint I/O: everything that reads or writes model files.

- ``run``: a run's ``step_N/`` checkpoints (policy, optimizer, driver state), retention, resume
  from the newest that verifies;
- ``manifest``: every file of a checkpoint with its size and xxh3-64 checksum (digested while
  Megatron's writers write), and its verification;
- ``megatron``: Megatron distributed checkpoints of a model (save, load, read in place) and the
  ``megagrpo.json`` that describes one;
- ``hf_files``: HF directories: safetensors reader (lazy, validated) and sharded streaming writer;
- ``hf_weights``: HF tensors into a model stage (policy start, import) and out of full Megatron
  tensors (export);
- ``convert``: HF <-> Megatron conversion (``hf_to_megatron``, ``megatron_to_hf``);
- ``files``, ``dist_files``, ``durable``: the zero-copy file layer (mapped reads, kernel copies),
  views of a torch_dist checkpoint's chunks, and the one durable commit (``durable.publish``) that
  every writer in the project goes through.

What a model *is* (shape, HF map, layout) lives in ``megagrpo.models``; this package only moves
its bytes.
"""


class CheckpointError(ValueError):
    """An input checkpoint is malformed; the message names the file and tensor."""
