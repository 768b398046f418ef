"""What a model is, apart from where its bytes live (that is ``megagrpo.ckpt``).

- ``registry``: supported HF architectures, ``config.json`` -> shape (refusing what we would build
  differently), and the HF config of a shape;
- ``shape``: ``GPTShape`` and Megatron's vocabulary padding;
- ``mapping``: the declarative HF <-> Megatron parameter map (renames, QKV and gate/up transforms);
- ``layout``: how a tensor is laid out over TP and PP ranks, and a stage's global parameter names;
- ``builder``: the Megatron ``TransformerConfig``, layer spec and ``GPTModel`` stage;
- ``torch_layers``: the ``torch`` layer spec (Megatron's local layer with PyTorch SDPA / varlen
  attention and ``torch.nn.RMSNorm``);
- ``description``: ``ModelDescription``, the model a job builds (architecture, shape, dtype, files).
"""
